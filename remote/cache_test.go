package remote

import (
	"errors"
	"testing"
)

// TestCacheSlots: pinned and loading slots are never reused; with every
// slot busy, get says noSlot; CLOCK gives a hit chunk a second chance; a
// failed load leaves the index so the next reader loads it again.
func TestCacheSlots(t *testing.T) {
	c := newCache(4096, 3*4096)
	k := func(i int64) chunkKey { return chunkKey{1, i} }
	load := func(i int64) *slot {
		t.Helper()
		s, r := c.get(k(i))
		if r != reserved {
			t.Fatalf("get(%d) = %v, want reserved", i, r)
		}
		s.buf[0] = byte(i)
		c.finish(s, 4096, nil)
		return s
	}
	a, b := load(0), load(1)
	s2, r := c.get(k(2)) // loading, pinned
	if r != reserved {
		t.Fatalf("get(2) = %v", r)
	}
	if _, r := c.get(k(3)); r != noSlot {
		t.Fatalf("every slot pinned: get(3) = %v, want noSlot", r)
	}
	if s, r := c.get(k(2)); r != wait || s != s2 {
		t.Fatalf("get of a loading chunk = %v, want wait on its slot", r)
	} else {
		s.unpin()
	}
	c.finish(s2, 4096, errors.New("boom"))
	s2.unpin()
	s, r := c.get(k(2))
	if r != reserved {
		t.Fatalf("after a failed load get(2) = %v, want reserved again", r)
	}
	c.finish(s, 4096, nil)
	s.unpin()
	a.unpin()
	b.unpin()
	// All three ready with their reference bits set: the hand clears them
	// in one sweep and takes chunk 0's slot (the oldest). Touch chunk 1 in
	// between: it must survive the next eviction too.
	s, r = c.get(k(3))
	if r != reserved {
		t.Fatalf("get(3) = %v", r)
	}
	c.finish(s, 4096, nil)
	s.unpin()
	if s, r := c.get(k(1)); r != hit || s.buf[0] != 1 {
		t.Fatalf("chunk 1 = %v", r)
	} else {
		s.unpin()
	}
	s, _ = c.get(k(4))
	c.finish(s, 4096, nil)
	s.unpin()
	if s, r := c.get(k(1)); r != hit {
		t.Errorf("chunk 1, touched, was evicted before untouched chunk 2 (%v)", r)
	} else {
		s.unpin()
	}
	if bufs, chunks := c.stats(); bufs != 3 || chunks != 3 {
		t.Errorf("stats: %d buffers, %d chunks; want 3, 3", bufs, chunks)
	}
	c.drop(1)
	if _, chunks := c.stats(); chunks != 0 {
		t.Errorf("drop left %d chunks", chunks)
	}
}
