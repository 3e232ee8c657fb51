package qcow2

import (
	"runtime"
	"sync"
	"sync/atomic"
)

// DefaultCacheSize is the default byte budget of a Cache: 32 MiB of L2
// tables map 256 GiB of virtual disk at 64 KiB clusters (one 64 KiB table
// maps 512 MiB).
const DefaultCacheSize = 32 << 20

// A Cache holds decoded metadata tables (L2 tables and refcount blocks) for
// any number of images, within a byte budget, and the decompressed-cluster
// cache (clustercache.go) in a budget of its own. One Cache is normally
// shared by every image of a mount, so the daemon's memory is bounded by it
// whatever the number or size of the images.
//
// Tables are found without a lock (clockcache.go). A miss publishes a
// placeholder, loads the table outside any lock and closes the
// placeholder's ready channel: concurrent readers of one table wait for a
// single load. A failed load is not cached.
type Cache struct {
	tables    clockCache[cacheKey, *cacheEntry]
	nextOwner atomic.Uint64

	// clusters holds decompressed clusters, in a budget of its own.
	clusters *clusterCache
	// inflaters bounds the goroutines inflating clusters in the
	// background or in parallel for one read, across all images.
	inflaters chan struct{}
	// firstInflate runs onInflate once, at the first cluster inflated.
	firstInflate sync.Once
	onInflate    func()
}

// cacheKey names a table: which layer (owner) and where in its file.
type cacheKey struct {
	owner uint64
	off   int64
}

// A table is one cached cluster of 64-bit words: an L2 table or a refcount
// block. Its words are read with atomic loads, never under a lock, so that
// a writer can change entries in place while requests read them. An
// extended L2 entry is two words; seq is a sequence lock for those: a
// writer makes it odd while it changes a pair, and a reader retries a pair
// read while seq was odd or moved (entry).
type table struct {
	words []uint64
	seq   atomic.Uint64

	// dirtyLo and dirtyHi bound the words changed since the table was
	// last written back ([lo, hi), empty when lo >= hi). Guarded by the
	// writer's mutex, as are all changes to words.
	dirtyLo, dirtyHi int
}

// word returns word i.
func (t *table) word(i int64) uint64 { return atomic.LoadUint64(&t.words[i]) }

// entry returns L2 entry i: one word, or with extended entries the entry
// and its subcluster bitmap, read as a consistent pair.
func (t *table) entry(i int64, extended bool) l2Entry {
	if !extended {
		return l2Entry{word: t.word(i)}
	}
	for {
		s := t.seq.Load()
		if s&1 == 0 {
			e := l2Entry{word: t.word(2 * i), bitmap: t.word(2*i + 1)}
			if t.seq.Load() == s {
				return e
			}
		}
		runtime.Gosched()
	}
}

// set changes word i, to be written back.
func (t *table) set(i int64, w uint64) {
	atomic.StoreUint64(&t.words[i], w)
	t.touch(int(i), int(i)+1)
}

// setEntry changes L2 entry i, with its bitmap for extended entries (under
// the sequence lock, so that readers see both words change together).
func (t *table) setEntry(i int64, e l2Entry, extended bool) {
	if !extended {
		t.set(i, e.word)
		return
	}
	t.seq.Add(1)
	atomic.StoreUint64(&t.words[2*i], e.word)
	atomic.StoreUint64(&t.words[2*i+1], e.bitmap)
	t.seq.Add(1)
	t.touch(int(2*i), int(2*i)+2)
}

func (t *table) touch(lo, hi int) {
	if t.dirtyLo >= t.dirtyHi {
		t.dirtyLo, t.dirtyHi = lo, hi
		return
	}
	t.dirtyLo, t.dirtyHi = min(t.dirtyLo, lo), max(t.dirtyHi, hi)
}

type cacheEntry struct {
	key    cacheKey
	table  *table
	err    error
	ready  chan struct{} // closed once table or err is set
	loaded atomic.Bool   // set with ready, read without touching the channel
	ref    atomic.Bool   // CLOCK reference bit
	pins   atomic.Int32  // > 0: not to be evicted (unwritten changes)
}

func (e *cacheEntry) refBit() *atomic.Bool { return &e.ref }
func (e *cacheEntry) bytes() int64         { return int64(len(e.table.words)) * 8 }
func (e *cacheEntry) pinned() bool         { return e.pins.Load() > 0 }

// NewCache returns a cache holding at most tables bytes of metadata tables
// and clusters bytes of decompressed clusters. (At least one entry per
// shard is always kept, so tiny budgets still work.)
func NewCache(tables, clusters int64) *Cache {
	c := &Cache{
		clusters:  newClusterCache(clusters),
		inflaters: make(chan struct{}, runtime.GOMAXPROCS(0)),
	}
	c.tables.init(tables, func(e *cacheEntry) cacheKey { return e.key })
	return c
}

// WhenInflating arranges for f to run once, in the goroutine that inflates
// the first compressed cluster read through c: inflating is a cgo call of
// tens of microseconds, during which the goroutine holds its P, and a
// caller may want to schedule around that (the daemon gives itself more
// Ps; docs/design.md says why this is a hook). Set it before the cache is
// used.
func (c *Cache) WhenInflating(f func()) { c.onInflate = f }

// inflating notes that a cluster is about to be inflated.
func (c *Cache) inflating() {
	if c.onInflate != nil {
		c.firstInflate.Do(c.onInflate)
	}
}

// newOwner returns a key space for one layer's tables.
func (c *Cache) newOwner() uint64 { return c.nextOwner.Add(1) }

// Stats returns the number of table hits and misses so far.
func (c *Cache) Stats() (hits, misses uint64) { return c.tables.stats() }

// get returns the table for k, calling load to read it on a miss. A failed
// load is not cached: the next get tries again.
func (c *Cache) get(k cacheKey, load func() ([]uint64, error)) (*table, error) {
	e, err := c.entry(k, load)
	if err != nil {
		return nil, err
	}
	return e.table, nil
}

func (c *Cache) entry(k cacheKey, load func() ([]uint64, error)) (*cacheEntry, error) {
	for {
		e, ok := c.tables.load(k)
		if !ok {
			break
		}
		if !e.loaded.Load() {
			<-e.ready
		}
		if e.err == nil {
			c.tables.shard(k).hits.Add(1)
			return e, nil
		}
		// The load that published this error removes the entry;
		// wait for that, then try ourselves.
		c.tables.unpublish(e)
	}

	e := &cacheEntry{key: k, ready: make(chan struct{})}
	if _, loaded := c.tables.publish(k, e); loaded {
		// Lost the race to another miss: share its load.
		return c.entry(k, load)
	}
	c.tables.shard(k).misses.Add(1)
	words, err := load()
	if err == nil {
		e.table = &table{words: words}
	}
	e.err = err
	e.loaded.Store(true)
	close(e.ready)
	if err != nil {
		c.tables.unpublish(e)
		return nil, err
	}
	c.tables.admit(e, nil)
	return e, nil
}

// pin returns the table for k, loading it if needed, pinned: it stays in
// the cache, with whatever is changed in it, until unpin. The writer pins
// every table it changes until the change is written back, so the table a
// reader finds is always the one with the latest changes.
func (c *Cache) pin(k cacheKey, load func() ([]uint64, error)) (*cacheEntry, error) {
	for {
		e, err := c.entry(k, load)
		if err != nil {
			return nil, err
		}
		// Under the shard's lock eviction cannot run: the entry is
		// either still in the cache, and pinned now, or gone (evicted,
		// so unchanged: load it again).
		s := c.tables.shard(k)
		s.mu.Lock()
		if cur, ok := c.tables.m.Load(k); ok && cur == e {
			e.pins.Add(1)
			s.mu.Unlock()
			return e, nil
		}
		s.mu.Unlock()
	}
}

// unpin releases a pin.
func (c *Cache) unpin(e *cacheEntry) { e.pins.Add(-1) }

// put installs a table the writer made (a new L2 table or refcount block)
// for k, pinned, replacing any cached table there.
func (c *Cache) put(k cacheKey, words []uint64) *cacheEntry {
	e := &cacheEntry{key: k, table: &table{words: words}, ready: make(chan struct{})}
	e.pins.Store(1)
	e.loaded.Store(true)
	close(e.ready)
	for {
		if old, loaded := c.tables.publish(k, e); loaded {
			c.tables.unpublish(old)
			continue
		}
		break
	}
	c.tables.admit(e, nil)
	return e
}

// drop removes every table of owner; it is called when a layer is closed.
func (c *Cache) drop(owner uint64) {
	c.tables.removeIf(func(e *cacheEntry) bool { return e.key.owner == owner }, nil)
}
