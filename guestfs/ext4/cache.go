package ext4

import "sync"

// blockCache holds up to a fixed number of blocks, in shards each guarded
// by its own mutex and evicting by CLOCK (second chance). Buffers in it
// are never changed, so a reader keeps using one after its eviction.
type blockCache struct {
	shards []cacheShard
}

type cacheShard struct {
	mu      sync.Mutex
	index   map[uint64]int // block number -> slot
	slots   []cacheSlot
	hand    int
	maxSize int
}

type cacheSlot struct {
	pblk uint64
	data []byte
	ref  bool
}

const cacheShards = 16

func newBlockCache(bytes int64, bs int64) *blockCache {
	per := int(bytes / bs / cacheShards)
	if per < 4 {
		per = 4
	}
	c := &blockCache{shards: make([]cacheShard, cacheShards)}
	for i := range c.shards {
		c.shards[i].index = make(map[uint64]int)
		c.shards[i].maxSize = per
	}
	return c
}

func (c *blockCache) shard(pblk uint64) *cacheShard {
	// Neighbouring blocks land in different shards.
	return &c.shards[(pblk*0x9E3779B97F4A7C15)>>60]
}

func (c *blockCache) get(pblk uint64) []byte {
	s := c.shard(pblk)
	s.mu.Lock()
	defer s.mu.Unlock()
	i, ok := s.index[pblk]
	if !ok {
		return nil
	}
	s.slots[i].ref = true
	return s.slots[i].data
}

func (c *blockCache) put(pblk uint64, data []byte) {
	s := c.shard(pblk)
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.index[pblk]; ok {
		return
	}
	if len(s.slots) < s.maxSize {
		s.index[pblk] = len(s.slots)
		s.slots = append(s.slots, cacheSlot{pblk: pblk, data: data})
		return
	}
	for s.slots[s.hand].ref {
		s.slots[s.hand].ref = false
		s.hand = (s.hand + 1) % len(s.slots)
	}
	delete(s.index, s.slots[s.hand].pblk)
	s.slots[s.hand] = cacheSlot{pblk: pblk, data: data}
	s.index[pblk] = s.hand
	s.hand = (s.hand + 1) % len(s.slots)
}

// reset empties the cache (after a journal replay changed what blocks
// read as).
func (c *blockCache) reset() {
	for i := range c.shards {
		s := &c.shards[i]
		s.mu.Lock()
		s.index = make(map[uint64]int)
		s.slots, s.hand = nil, 0
		s.mu.Unlock()
	}
}
