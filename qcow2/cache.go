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
// The cache is sharded by key. A hit takes only its shard's read lock and
// sets the entry's reference bit atomically; no request takes an exclusive
// lock on a hit. A miss takes the shard's write lock to insert a
// placeholder, loads the table outside any lock, and publishes it by
// closing the placeholder's ready channel, so concurrent readers of the same
// table wait for one load instead of each reading it. Eviction is CLOCK
// (second chance) within a shard, under the shard's write lock.
type Cache struct {
	seed      maphash.Seed
	shards    [cacheShards]cacheShard
	nextOwner atomic.Uint64

	hits, misses atomic.Uint64
}

// cacheKey names a table: which layer (owner) and where in its file.
type cacheKey struct {
	owner uint64
	off   int64
}

type cacheEntry struct {
	key   cacheKey
	table []uint64
	err   error
	ready chan struct{} // closed once table or err is set
	ref   atomic.Bool   // CLOCK reference bit
}

// cacheShard: mu guards m, ring, hand and bytes. Entries' table and err
// are written once before ready is closed and only read after.
type cacheShard struct {
	mu       sync.RWMutex
	m        map[cacheKey]*cacheEntry
	ring     []*cacheEntry
	hand     int
	bytes    int64
	capacity int64
}

// NewCache returns a cache holding at most size bytes of tables (at least
// one table per shard is always kept, so tiny budgets still work).
func NewCache(size int64) *Cache {
	c := &Cache{seed: maphash.MakeSeed()}
	for i := range c.shards {
		c.shards[i].m = make(map[cacheKey]*cacheEntry)
		c.shards[i].capacity = size / cacheShards
	}
	return c
}

// newOwner returns a key space for one layer's tables.
func (c *Cache) newOwner() uint64 { return c.nextOwner.Add(1) }

// Stats returns the number of hits and misses so far.
func (c *Cache) Stats() (hits, misses uint64) { return c.hits.Load(), c.misses.Load() }

func (c *Cache) shard(k cacheKey) *cacheShard {
	return &c.shards[maphash.Comparable(c.seed, k)%cacheShards]
}

// get returns the table for k, calling load to read it on a miss. A failed
// load is not cached: the next get tries again.
func (c *Cache) get(k cacheKey, load func() ([]uint64, error)) ([]uint64, error) {
	s := c.shard(k)
	s.mu.RLock()
	e := s.m[k]
	s.mu.RUnlock()
	if e != nil {
		e.ref.Store(true)
		<-e.ready
		if e.err == nil {
			c.hits.Add(1)
			return e.table, nil
		}
		// Fall through: the load that published this error has
		// already removed the entry; try once ourselves.
	}

	s.mu.Lock()
	if e = s.m[k]; e != nil {
		s.mu.Unlock()
		e.ref.Store(true)
		<-e.ready
		if e.err == nil {
			c.hits.Add(1)
		}
		return e.table, e.err
	}
	e = &cacheEntry{key: k, ready: make(chan struct{})}
	s.m[k] = e
	s.mu.Unlock()

	c.misses.Add(1)
	table, err := load()
	e.table, e.err = table, err
	close(e.ready)

	s.mu.Lock()
	if err != nil {
		if s.m[k] == e {
			delete(s.m, k)
		}
	} else if s.m[k] == e {
		s.insert(e)
	}
	s.mu.Unlock()
	return table, err
}

// insert adds a loaded entry to the CLOCK ring, evicting others until the
// shard is within its budget. Called with s.mu held.
func (s *cacheShard) insert(e *cacheEntry) {
	size := int64(len(e.table)) * 8
	for s.bytes+size > s.capacity && len(s.ring) > 0 {
		s.evictOne()
	}
	s.ring = append(s.ring, e)
	s.bytes += size
}

// evictOne advances the clock hand to the first entry whose reference bit
// is clear, clearing bits as it passes, and removes that entry.
func (s *cacheShard) evictOne() {
	for {
		if s.hand >= len(s.ring) {
			s.hand = 0
		}
		e := s.ring[s.hand]
		if e.ref.Swap(false) {
			s.hand++
			continue
		}
		last := len(s.ring) - 1
		s.ring[s.hand] = s.ring[last]
		s.ring[last] = nil
		s.ring = s.ring[:last]
		delete(s.m, e.key)
		s.bytes -= int64(len(e.table)) * 8
		return
	}
}

// drop removes every table of owner; it is called when a layer is closed.
func (c *Cache) drop(owner uint64) {
	for i := range c.shards {
		s := &c.shards[i]
		s.mu.Lock()
		for j := 0; j < len(s.ring); {
			if e := s.ring[j]; e.key.owner == owner {
				last := len(s.ring) - 1
				s.ring[j] = s.ring[last]
				s.ring[last] = nil
				s.ring = s.ring[:last]
				delete(s.m, e.key)
				s.bytes -= int64(len(e.table)) * 8
				continue
			}
			j++
		}
		s.mu.Unlock()
	}
}
