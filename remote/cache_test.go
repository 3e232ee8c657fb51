package remote

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
)

// testChunk is chunk i of object 1, the object of the cache tests.
func testChunk(i int64) chunkKey { return chunkKey{1, i} }

// loadChunk loads chunk i into c (its first byte is i) and returns its
// slot, still pinned.
func loadChunk(t *testing.T, c *cache, i int64) *slot {
	t.Helper()
	s, r := c.get(testChunk(i))
	if r != reserved {
		t.Fatalf("get(%d) = %v, want reserved", i, r)
	}
	s.buf[0] = byte(i)
	c.finish(s, 4096, nil)
	return s
}

// TestCacheSlots: pinned and loading slots are never reused; with every
// slot busy, get says noSlot; CLOCK gives a hit chunk a second chance; a
// failed load leaves the index so the next reader loads it again.
func TestCacheSlots(t *testing.T) {
	c := newCache(4096, 3*4096)
	load := func(i int64) *slot { return loadChunk(t, c, i) }
	a, b := load(0), load(1)
	s2, r := c.get(testChunk(2)) // loading, pinned
	if r != reserved {
		t.Fatalf("get(2) = %v", r)
	}
	if _, r := c.get(testChunk(3)); r != noSlot {
		t.Fatalf("every slot pinned: get(3) = %v, want noSlot", r)
	}
	if s, r := c.get(testChunk(2)); r != wait || s != s2 {
		t.Fatalf("get of a loading chunk = %v, want wait on its slot", r)
	} else {
		s.unpin()
	}
	c.finish(s2, 4096, errors.New("boom"))
	s2.unpin()
	s, r := c.get(testChunk(2))
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
	s, r = c.get(testChunk(3))
	if r != reserved {
		t.Fatalf("get(3) = %v", r)
	}
	c.finish(s, 4096, nil)
	s.unpin()
	if s, r := c.get(testChunk(1)); r != hit || s.buf[0] != 1 {
		t.Fatalf("chunk 1 = %v", r)
	} else {
		s.unpin()
	}
	s, _ = c.get(testChunk(4))
	c.finish(s, 4096, nil)
	s.unpin()
	if s, r := c.get(testChunk(1)); r != hit {
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

// TestCacheRelease: a released chunk stays cached until a slot is needed,
// then its slot is the one taken, before the hand's; a released chunk hit
// again (a reader behind the scan) is not taken first. (That a scan's
// released slots keep the other chunks cached is TestScanKeepsEarlierChunks.)
func TestCacheRelease(t *testing.T) {
	c := newCache(4096, 4*4096)
	load := func(i int64) *slot {
		t.Helper()
		s := loadChunk(t, c, i)
		s.unpin()
		return s
	}
	hits := func(ids ...int64) {
		t.Helper()
		for _, i := range ids {
			s, r := c.get(testChunk(i))
			if r != hit || s.buf[0] != byte(i) {
				t.Fatalf("chunk %d = %v, want a hit", i, r)
			}
			s.unpin()
		}
	}
	for i := range int64(4) {
		load(i)
	}
	c.release(1, 2, 3)
	hits(2) // still cached; this hit makes it wanted again
	c.release(1, 2, 3)
	load(4) // takes chunk 2's slot
	hits(0, 1, 3, 4)
	if _, r := c.get(testChunk(2)); r != reserved {
		t.Fatalf("chunk 2 = %v, want reserved: its slot should have been reused", r)
	}

	// Two slots: A released, then hit again; B not referenced since the
	// hand's last pass. The next load must take B, not A.
	c = newCache(4096, 2*4096)
	a, b := load(10), load(11)
	c.release(1, 10, 11)
	hits(10)
	c.mu.Lock()
	b.ref = false
	c.mu.Unlock()
	load(12)
	hits(10, 12)
	if a.key != testChunk(10) {
		t.Fatalf("chunk 10's slot now holds %v", a.key)
	}
}

// TestDiskCacheSamePutAtOnce: a reader's fetch and a hydration may put the
// same chunk at once. Each write goes to a file of its own, renamed into
// place whole: a get between them finds the chunk whole or not at all,
// never a file another put truncated under it ("damaged"), and no put
// fails because another renamed its file away.
func TestDiskCacheSamePutAtOnce(t *testing.T) {
	var log logBuf
	d, err := openDiskCache(t.TempDir(), 1<<30, slog.New(slog.NewTextHandler(&log, nil)))
	if err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte("qcowfs chunk "), 20<<10)
	const rounds = 200
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range rounds {
				d.put("obj", 7, data)
			}
		}()
	}
	buf := make([]byte, len(data))
	for range 4 * rounds {
		if n, ok := d.get("obj", 7, buf); ok && !bytes.Equal(buf[:n], data) {
			t.Fatal("a get returned other bytes than were put")
		}
	}
	wg.Wait()
	if strings.Contains(log.String(), "damaged") || strings.Contains(log.String(), "cannot write") {
		t.Errorf("a put was cut by the other:\n%s", log.String())
	}
	if n, ok := d.get("obj", 7, buf); !ok || !bytes.Equal(buf[:n], data) {
		t.Error("the chunk is not whole after the puts")
	}
}
