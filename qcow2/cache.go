package qcow2

import (
	"hash/maphash"
	"runtime"
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

	// clusters holds decompressed clusters, in a budget of its own.
	clusters *clusterCache
	// inflaters bounds the goroutines inflating clusters in the
	// background or in parallel for one read, across all images.
	inflaters chan struct{}
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

func (e *cacheEntry) refBit() *atomic.Bool { return &e.ref }
func (e *cacheEntry) bytes() int64         { return int64(len(e.table)) * 8 }

// cacheShard: mu guards ring.
type cacheShard struct {
	mu   sync.Mutex
	ring clockRing[*cacheEntry]

	hits, misses atomic.Uint64
	_            [64]byte // keep shards' counters on separate cache lines
}

// NewCache returns a cache holding at most tables bytes of metadata tables
// and clusters bytes of decompressed clusters. (At least one entry per
// shard is always kept, so tiny budgets still work.)
func NewCache(tables, clusters int64) *Cache {
	c := &Cache{
		seed:      maphash.MakeSeed(),
		clusters:  newClusterCache(clusters),
		inflaters: make(chan struct{}, runtime.GOMAXPROCS(0)),
	}
	for i := range c.shards {
		c.shards[i].ring.capacity = tables / cacheShards
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
	s.ring.add(e, c.forget)
	s.mu.Unlock()
	return table, nil
}

// forget drops an evicted entry from the map (unless it was replaced).
func (c *Cache) forget(e *cacheEntry) { c.m.CompareAndDelete(e.key, e) }

// drop removes every table of owner; it is called when a layer is closed.
func (c *Cache) drop(owner uint64) {
	for i := range c.shards {
		s := &c.shards[i]
		s.mu.Lock()
		s.ring.removeIf(func(e *cacheEntry) bool { return e.key.owner == owner }, c.forget)
		s.mu.Unlock()
	}
}
