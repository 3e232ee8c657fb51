package qcow2

import (
	"hash/maphash"
	"sync"
	"sync/atomic"
)

// clockCache is the skeleton of the package's two shared caches (L2 tables
// and refcount blocks in cache.go, decompressed clusters in
// clustercache.go): a sync.Map, whose reads take no lock, in front of
// per-shard CLOCK rings (clockring.go) that keep the entries within a byte
// budget. A hit costs a map load and, at most, one atomic store of the
// entry's reference bit. Each shard's mutex guards its ring and is taken
// only to admit an entry (a miss) or to drop entries.
//
// The caches built on it decide what an entry holds and how a miss is
// filled; the skeleton only maps keys to entries and evicts.
type clockCache[K comparable, E clockEntry] struct {
	seed   maphash.Seed
	m      sync.Map // K -> E
	keyOf  func(E) K
	shards [cacheShards]clockShard[E]
}

const cacheShards = 16

// clockShard: mu guards ring.
type clockShard[E clockEntry] struct {
	mu   sync.Mutex
	ring clockRing[E]

	hits, misses atomic.Uint64
	_            [64]byte // keep shards' counters on separate cache lines
}

// init sets the budget, split evenly between the shards, and how to find
// an entry's key.
func (c *clockCache[K, E]) init(budget int64, keyOf func(E) K) {
	c.seed = maphash.MakeSeed()
	c.keyOf = keyOf
	for i := range c.shards {
		c.shards[i].ring.capacity = budget / cacheShards
	}
}

func (c *clockCache[K, E]) shard(k K) *clockShard[E] {
	return &c.shards[maphash.Comparable(c.seed, k)%cacheShards]
}

// load returns the entry for k, if any, setting its reference bit.
func (c *clockCache[K, E]) load(k K) (E, bool) {
	v, ok := c.m.Load(k)
	if !ok {
		var zero E
		return zero, false
	}
	e := v.(E)
	if r := e.refBit(); !r.Load() {
		r.Store(true)
	}
	return e, true
}

// publish stores e for k unless another entry is there, which it returns
// with loaded set.
func (c *clockCache[K, E]) publish(k K, e E) (actual E, loaded bool) {
	v, loaded := c.m.LoadOrStore(k, e)
	return v.(E), loaded
}

// unpublish removes e (and only e) from the map.
func (c *clockCache[K, E]) unpublish(e E) { c.m.CompareAndDelete(c.keyOf(e), e) }

// admit puts a published entry into its shard's ring, evicting others
// until it fits; each evicted entry leaves the map and is passed to
// evicted, if not nil.
func (c *clockCache[K, E]) admit(e E, evicted func(E)) {
	s := c.shard(c.keyOf(e))
	s.mu.Lock()
	s.ring.add(e, c.leaving(evicted))
	s.mu.Unlock()
}

// leaving returns what happens to an entry the ring lets go: it leaves the
// map, then is passed to evicted, if not nil.
func (c *clockCache[K, E]) leaving(evicted func(E)) func(E) {
	return func(old E) {
		c.unpublish(old)
		if evicted != nil {
			evicted(old)
		}
	}
}

// removeIf drops every admitted entry for which drop is true, as if
// evicted.
func (c *clockCache[K, E]) removeIf(drop func(E) bool, evicted func(E)) {
	leave := c.leaving(evicted)
	for i := range c.shards {
		s := &c.shards[i]
		s.mu.Lock()
		s.ring.removeIf(drop, leave)
		s.mu.Unlock()
	}
}

// stats sums the shards' hit and miss counters.
func (c *clockCache[K, E]) stats() (hits, misses uint64) {
	for i := range c.shards {
		hits += c.shards[i].hits.Load()
		misses += c.shards[i].misses.Load()
	}
	return hits, misses
}
