package qcow2

import (
	"sync"
	"sync/atomic"
)

// DefaultClusterCacheSize is the default byte budget for decompressed
// clusters: room for the clusters that parallel inflate works on ahead of
// a few sequential readers, and for random reads to find a cluster again.
const DefaultClusterCacheSize = 64 << 20

// clusterCache holds decompressed clusters within a byte budget, shared by
// every image of a Cache. It makes 4 KiB reads inside one compressed
// cluster inflate it once, not once per read, and lets concurrent readers
// of one cluster wait for a single inflate.
//
// Buffers are recycled, so a reader must hold an entry (acquire/release)
// while it copies out of it: an entry's state counts its holders, and its
// buffer goes back to the pool only once it is both evicted and released
// by its last holder. Lookups and eviction are clockCache's.
type clusterCache struct {
	entries clockCache[clusterKey, *clusterEntry]
	pools   sync.Map // cluster size -> *sync.Pool of *[]byte
}

// clusterKey names a compressed cluster by layer and host offset of its
// compressed data (so snapshots sharing a cluster share its entry).
type clusterKey struct {
	owner uint64
	off   int64
}

const evictedBit = 1 << 62

type clusterEntry struct {
	key   clusterKey
	buf   *[]byte
	err   error
	ready chan struct{}
	// state counts the holders of buf; evictedBit is set once the entry
	// left the cache. The buffer is recycled when state is exactly
	// evictedBit.
	state atomic.Int64
	ref   atomic.Bool
	pool  *sync.Pool
}

func (e *clusterEntry) refBit() *atomic.Bool { return &e.ref }
func (e *clusterEntry) pinned() bool         { return false }
func (e *clusterEntry) bytes() int64         { return int64(cap(*e.buf)) }

// data is the decompressed cluster; valid while the entry is held.
func (e *clusterEntry) data() []byte { return *e.buf }

// acquire takes a hold on e, failing if e was evicted meanwhile.
func (e *clusterEntry) acquire() bool {
	for {
		s := e.state.Load()
		if s&evictedBit != 0 {
			return false
		}
		if e.state.CompareAndSwap(s, s+1) {
			return true
		}
	}
}

// release gives a hold back; the last holder of an evicted entry recycles
// its buffer.
func (e *clusterEntry) release() {
	if e.state.Add(-1) == evictedBit {
		e.recycle()
	}
}

// evict marks e gone from the cache, recycling its buffer if nobody holds it.
func (e *clusterEntry) evict() {
	if e.state.Add(evictedBit) == evictedBit {
		e.recycle()
	}
}

func (e *clusterEntry) recycle() {
	if e.buf != nil && e.err == nil {
		e.pool.Put(e.buf)
	}
}

func newClusterCache(size int64) *clusterCache {
	c := &clusterCache{}
	c.entries.init(size, func(e *clusterEntry) clusterKey { return e.key })
	return c
}

// pool returns the pool of recycled n-byte buffers.
func (c *clusterCache) pool(n int) *sync.Pool {
	if p, ok := c.pools.Load(n); ok {
		return p.(*sync.Pool)
	}
	p, _ := c.pools.LoadOrStore(n, &sync.Pool{New: func() any {
		b := make([]byte, n)
		return &b
	}})
	return p.(*sync.Pool)
}

// get returns the held entry for k, calling fill to decompress the cluster
// (size bytes) on a miss. The caller must release the entry. A failed fill
// is not cached.
func (c *clusterCache) get(k clusterKey, size int, fill func(dst []byte) error) (*clusterEntry, error) {
	for {
		if e, ok := c.entries.load(k); ok {
			<-e.ready
			if e.err != nil {
				c.entries.unpublish(e)
				return nil, e.err
			}
			if e.acquire() {
				return e, nil
			}
			continue // evicted meanwhile: look again
		}
		pool := c.pool(size)
		e := &clusterEntry{key: k, ready: make(chan struct{}), pool: pool}
		if _, loaded := c.entries.publish(k, e); loaded {
			continue
		}
		e.buf = pool.Get().(*[]byte)
		e.state.Store(1) // held by us
		e.err = fill(*e.buf)
		close(e.ready)
		if e.err != nil {
			c.entries.unpublish(e)
			e.pool.Put(e.buf)
			return nil, e.err
		}
		c.entries.admit(e, (*clusterEntry).evict)
		return e, nil
	}
}

// contains reports whether cluster k is cached or being filled.
func (c *clusterCache) contains(k clusterKey) bool {
	_, ok := c.entries.m.Load(k)
	return ok
}

// drop evicts every cluster of owner.
func (c *clusterCache) drop(owner uint64) {
	c.entries.removeIf(func(e *clusterEntry) bool { return e.key.owner == owner }, (*clusterEntry).evict)
}
