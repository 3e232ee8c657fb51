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
// list to relink. Chunks unlikely to be read again (those a sequential
// reader has read through, and a closed object's) are queued for reuse,
// and once every slot has a buffer the queue is drained before the hand
// moves: a scan through a cache
// smaller than the object then cycles through its own slots and leaves
// the other chunks alone, instead of sweeping them out. A queued chunk
// stays cached until its slot is taken, and a hit meanwhile (a reader
// behind the scan) takes it off the queue.
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
	// queue is the slots to reuse first, oldest from head on; an entry is
	// stale once its slot holds another chunk, is pinned, or was hit since.
	queue []queued
	head  int
	// past remembers the chunks released since (at most len(slots) of
	// them, oldest forgotten first), cached or not: a prefetch skips them,
	// since a reader has been through them (another stream's window often
	// reaches back over what a stream read).
	past     map[chunkKey]struct{}
	pastRing []chunkKey
	pastNext int
}

// queued is a slot queued for reuse, with the chunk it held then.
type queued struct {
	s   *slot
	key chunkKey
}

func newCache(chunkSize, cacheSize int64) *cache {
	n := int(cacheSize / chunkSize)
	return &cache{
		chunk:    int(chunkSize),
		slots:    make([]slot, n),
		index:    make(map[chunkKey]*slot, n),
		past:     make(map[chunkKey]struct{}, n),
		pastRing: make([]chunkKey, n),
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
	delete(c.past, k) // read again: no longer a chunk to skip
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
// pinned or loading: once every slot has a buffer, a released one if there
// is one, else the hand's. Called with mu held.
func (c *cache) evict() *slot {
	for c.used == len(c.slots) && c.head < len(c.queue) {
		q := c.queue[c.head]
		c.queue[c.head] = queued{}
		c.head++
		s := q.s
		if s.pins.Load() != 0 || s.key != q.key {
			continue
		}
		switch {
		case s.state == slotFree:
			return s
		case s.state == slotReady && !s.ref:
			delete(c.index, s.key)
			s.state = slotFree
			return s
		}
	}
	if c.head == len(c.queue) {
		c.queue, c.head = c.queue[:0], 0
	}
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
			c.enqueue(s)
		}
	}
}

// release queues the ready chunks [from, to) of object id for reuse, and
// remembers them all (past): a sequential reader has read through them.
func (c *cache) release(id uint64, from, to int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := from; i < to; i++ {
		k := chunkKey{id, i}
		if s := c.index[k]; s != nil && s.state == slotReady {
			s.ref = false
			c.enqueue(s)
		}
		c.remember(k)
	}
}

// remember adds k to the released chunks, forgetting the oldest if full.
// Called with mu held.
func (c *cache) remember(k chunkKey) {
	if _, ok := c.past[k]; ok || len(c.pastRing) == 0 {
		return
	}
	delete(c.past, c.pastRing[c.pastNext])
	c.pastRing[c.pastNext] = k
	c.pastNext = (c.pastNext + 1) % len(c.pastRing)
	c.past[k] = struct{}{}
}

// wasReleased says whether chunk k was released lately (see past).
func (c *cache) wasReleased(k chunkKey) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, ok := c.past[k]
	return ok
}

// enqueue queues s, holding the chunk it holds now, for reuse. The queue
// holds at most one entry per slot beyond what was taken (older entries
// are compacted away). Called with mu held.
func (c *cache) enqueue(s *slot) {
	if len(c.queue)-c.head >= len(c.slots) {
		return
	}
	if c.head > len(c.slots) {
		n := copy(c.queue, c.queue[c.head:])
		clear(c.queue[n:])
		c.queue, c.head = c.queue[:n], 0
	}
	c.queue = append(c.queue, queued{s, s.key})
}

// stats reports the slots holding buffers and the ones holding chunks.
func (c *cache) stats() (buffers, chunks int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.used, len(c.index)
}
