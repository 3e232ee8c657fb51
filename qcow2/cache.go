package qcow2

import (
	"hash/maphash"
	"sync"
	"sync/atomic"
)

// DefaultCacheSize is the default byte budget of a Cache: 32 MiB of L2
// tables map 256 GiB of virtual disk at 64 KiB clusters (one 64 KiB table
// maps 512 MiB).
const DefaultCacheSize = 32 << 20

const cacheShards = 16

// A Cache holds decoded metadata tables (L2 tables) for any number of
// images, within a byte budget. One Cache is normally shared by every image
// of a mount, so the daemon's memory is bounded by it whatever the number
// or size of the images.
//
// Lookups go through a sync.Map, whose reads take no lock, and a hit only
// sets the entry's reference bit (an atomic store, skipped when the bit is
// already set), so requests on different cores do not serialize on a hit.
// A miss publishes a placeholder with LoadOrStore, loads the table outside
// any lock and closes the placeholder's ready channel: concurrent readers
// of one table wait for a single load. Eviction is CLOCK (second chance)
// over per-shard rings; each ring is guarded by its shard's mutex, which
// only misses take.
type Cache struct {
	seed      maphash.Seed
	m         sync.Map // cacheKey -> *cacheEntry
	shards    [cacheShards]cacheShard
	nextOwner atomic.Uint64
}

// cacheKey names a table: which layer (owner) and where in its file.
type cacheKey struct {
	owner uint64
	off   int64
}

type cacheEntry struct {
	key    cacheKey
	table  []uint64
	err    error
	ready  chan struct{} // closed once table or err is set
	loaded atomic.Bool   // set with ready, read without touching the channel
	ref    atomic.Bool   // CLOCK reference bit
}

// cacheShard: mu guards ring, hand and bytes.
type cacheShard struct {
	mu       sync.Mutex
	ring     []*cacheEntry
	hand     int
	bytes    int64
	capacity int64

	hits, misses atomic.Uint64
	_            [64]byte // keep shards' counters on separate cache lines
}

// NewCache returns a cache holding at most size bytes of tables (at least
// one table per shard is always kept, so tiny budgets still work).
func NewCache(size int64) *Cache {
	c := &Cache{seed: maphash.MakeSeed()}
	for i := range c.shards {
		c.shards[i].capacity = size / cacheShards
	}
	return c
}

// newOwner returns a key space for one layer's tables.
func (c *Cache) newOwner() uint64 { return c.nextOwner.Add(1) }

// Stats returns the number of hits and misses so far.
func (c *Cache) Stats() (hits, misses uint64) {
	for i := range c.shards {
		hits += c.shards[i].hits.Load()
		misses += c.shards[i].misses.Load()
	}
	return hits, misses
}

func (c *Cache) shard(k cacheKey) *cacheShard {
	return &c.shards[maphash.Comparable(c.seed, k)%cacheShards]
}

// get returns the table for k, calling load to read it on a miss. A failed
// load is not cached: the next get tries again.
func (c *Cache) get(k cacheKey, load func() ([]uint64, error)) ([]uint64, error) {
	for {
		v, ok := c.m.Load(k)
		if !ok {
			break
		}
		e := v.(*cacheEntry)
		if !e.ref.Load() {
			e.ref.Store(true)
		}
		if !e.loaded.Load() {
			<-e.ready
		}
		if e.err == nil {
			c.shard(k).hits.Add(1)
			return e.table, nil
		}
		// The load that published this error removes the entry;
		// wait for that, then try ourselves.
		c.m.CompareAndDelete(k, e)
	}

	e := &cacheEntry{key: k, ready: make(chan struct{})}
	if _, loaded := c.m.LoadOrStore(k, e); loaded {
		// Lost the race to another miss: share its load.
		return c.get(k, load)
	}
	s := c.shard(k)
	s.misses.Add(1)
	table, err := load()
	e.table, e.err = table, err
	e.loaded.Store(true)
	close(e.ready)
	if err != nil {
		c.m.CompareAndDelete(k, e)
		return nil, err
	}
	s.mu.Lock()
	s.insert(c, e)
	s.mu.Unlock()
	return table, nil
}

// insert adds a loaded entry to the CLOCK ring, evicting others until the
// shard is within its budget. Called with s.mu held.
func (s *cacheShard) insert(c *Cache, e *cacheEntry) {
	size := int64(len(e.table)) * 8
	for s.bytes+size > s.capacity && len(s.ring) > 0 {
		s.evictOne(c)
	}
	s.ring = append(s.ring, e)
	s.bytes += size
}

// evictOne advances the clock hand to the first entry whose reference bit
// is clear, clearing bits as it passes, and removes that entry.
func (s *cacheShard) evictOne(c *Cache) {
	for {
		if s.hand >= len(s.ring) {
			s.hand = 0
		}
		e := s.ring[s.hand]
		if e.ref.Swap(false) {
			s.hand++
			continue
		}
		s.removeAt(c, s.hand)
		return
	}
}

// removeAt drops ring entry i from the ring and the map. Called with s.mu
// held.
func (s *cacheShard) removeAt(c *Cache, i int) {
	e := s.ring[i]
	last := len(s.ring) - 1
	s.ring[i] = s.ring[last]
	s.ring[last] = nil
	s.ring = s.ring[:last]
	c.m.CompareAndDelete(e.key, e)
	s.bytes -= int64(len(e.table)) * 8
}

// drop removes every table of owner; it is called when a layer is closed.
func (c *Cache) drop(owner uint64) {
	for i := range c.shards {
		s := &c.shards[i]
		s.mu.Lock()
		for j := 0; j < len(s.ring); {
			if s.ring[j].key.owner == owner {
				s.removeAt(c, j)
				continue
			}
			j++
		}
		s.mu.Unlock()
	}
}
