package remote

import (
	"sync"
	"sync/atomic"
)

// chunkKey names one chunk: the object's cache id (one per URL, version and
// size, shared by every Object open on it) and the chunk's index.
type chunkKey struct {
	obj uint64
	idx int64
}

// slotState is where a slot is in its life. A slot is free (in no index
// entry), loading (in the index, its fetch in flight), or ready.
type slotState uint8

const (
	slotFree slotState = iota
	slotLoading
	slotReady
)

// A slot holds one chunk. Its buffer is allocated the first time the slot is
// used and then reused for every chunk it ever holds, so a busy cache causes
// no page faults or munmaps once warm.
//
// Lifetime: whoever finds a slot through cache.get holds a pin; a pinned
// slot is never reused, so the holder may read buf[:n] (once ready) or err
// (once done is closed) without a lock. Pins are taken under cache.mu and
// dropped without it.
type slot struct {
	key   chunkKey  // mu
	state slotState // mu
	ref   bool      // mu: the CLOCK reference bit
	pins  atomic.Int32

	// done is closed when a load ends; err is its result (nil: buf[:n] is
	// the chunk). The loader writes n, err and buf before closing done.
	done chan struct{}
	err  error
	n    int
	buf  []byte
}

func (s *slot) unpin() { s.pins.Add(-1) }

// getResult says what cache.get found.
type getResult uint8

const (
	hit      getResult = iota // ready: copy out, then unpin
	wait                      // another goroutine is loading it: wait for done
	reserved                  // the caller now loads it and must call finish
	noSlot                    // no slot can be had: read without the cache
)

// cache is the memory chunk cache shared by all objects of a Client: a
// fixed array of slots, CacheSize/ChunkSize of them, and an index from
// chunk to slot. Eviction is CLOCK (second chance): a hit sets the slot's
// reference bit; the hand clears bits as it sweeps, and takes the first
// slot that is unpinned, not loading, and not referenced since the hand's
// last pass. CLOCK makes a hit cost one map lookup and one store, with no
// list to relink.
//
// mu guards the index, the hand and each slot's key, state and ref. It is
// held for bookkeeping only: never while a chunk is fetched or copied.
type cache struct {
	chunk int

	mu    sync.Mutex
	slots []slot
	index map[chunkKey]*slot
	hand  int
	used  int // slots with a buffer
}

func newCache(chunkSize, cacheSize int64) *cache {
	n := int(cacheSize / chunkSize)
	return &cache{
		chunk: int(chunkSize),
		slots: make([]slot, n),
		index: make(map[chunkKey]*slot, n),
	}
}

// get finds chunk k. The slot returned is pinned (except with noSlot); on
// reserved it is loading under k, and the caller must fill it and call
// finish.
func (c *cache) get(k chunkKey) (*slot, getResult) {
	c.mu.Lock()
	if s := c.index[k]; s != nil {
		s.pins.Add(1)
		s.ref = true
		st := s.state
		c.mu.Unlock()
		if st == slotReady {
			return s, hit
		}
		return s, wait
	}
	s := c.evict()
	if s == nil {
		c.mu.Unlock()
		return nil, noSlot
	}
	s.key, s.state, s.ref = k, slotLoading, true
	s.done, s.err, s.n = make(chan struct{}), nil, 0
	s.pins.Add(1)
	c.index[k] = s
	fresh := s.buf == nil
	if fresh {
		c.used++
	}
	c.mu.Unlock()
	if fresh {
		s.buf = make([]byte, c.chunk)
	}
	return s, reserved
}

// evict returns a slot to reuse, out of the index, or nil if every slot is
// pinned or loading. Called with mu held.
func (c *cache) evict() *slot {
	for range 2 * len(c.slots) {
		s := &c.slots[c.hand]
		c.hand = (c.hand + 1) % len(c.slots)
		if s.state == slotLoading || s.pins.Load() != 0 {
			continue
		}
		if s.state == slotReady && s.ref {
			s.ref = false
			continue
		}
		if s.state == slotReady {
			delete(c.index, s.key)
			s.state = slotFree
		}
		return s
	}
	return nil
}

// finish ends the load of a reserved slot: with err nil, buf[:n] is the
// chunk and the slot is ready; otherwise it leaves the index (waiters see
// err, later readers load it again). The caller's pin stays.
func (c *cache) finish(s *slot, n int, err error) {
	s.n, s.err = n, err
	c.mu.Lock()
	if err == nil {
		s.state = slotReady
	} else {
		if c.index[s.key] == s {
			delete(c.index, s.key)
		}
		s.state = slotFree
		s.ref = false
	}
	close(s.done)
	c.mu.Unlock()
}

// drop forgets every ready chunk of object id, so a closed object's chunks
// are the first reused. Loading slots finish on their own.
func (c *cache) drop(id uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := range c.slots {
		s := &c.slots[i]
		if s.key.obj == id && s.state == slotReady {
			delete(c.index, s.key)
			s.state, s.ref = slotFree, false
		}
	}
}

// stats reports the slots holding buffers and the ones holding chunks.
func (c *cache) stats() (buffers, chunks int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.used, len(c.index)
}
