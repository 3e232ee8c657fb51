package readahead

import (
	"sync"
	"testing"
	"time"
)

// TestMemoryBound runs more concurrent streams than MaxStreams, so streams
// are replaced while their windows are being fetched and copied from, and
// checks that the buffers in use never exceed MaxStreams*2*MaxWindow.
func TestMemoryBound(t *testing.T) {
	const size = 32 << 20
	opts := Options{MinWindow: 4 << 10, MaxWindow: 32 << 10, MaxStreams: 4}
	m := newMemReader(size, 10)
	r := New(m, opts)
	limit := int64(opts.MaxStreams * 2 * opts.MaxWindow)
	if st := r.Stats(); st.BufferLimit != limit {
		t.Fatalf("BufferLimit = %d, want %d", st.BufferLimit, limit)
	}
	var wg sync.WaitGroup
	for g := range 24 {
		wg.Go(func() {
			start := int64(g) * (size / 24)
			for _, c := range clustersUpTo(size/24, 16<<10, uint64(g)) {
				if err := diffRead(r, m.oracle(), start+c.off, int(c.n)); err != nil {
					t.Error(err)
					return
				}
				if st := r.Stats(); st.BufferBytes > limit {
					t.Errorf("%d bytes of buffers in use, limit %d", st.BufferBytes, limit)
					return
				}
			}
		})
	}
	wg.Wait()
	st := r.Stats()
	t.Logf("%+v", st)
	if st.PeakBufferBytes > limit {
		t.Errorf("peak buffers %d bytes, limit %d", st.PeakBufferBytes, limit)
	}
	r.Close()
	if st := r.Stats(); st.BufferBytes != 0 {
		t.Errorf("%d bytes of buffers in use after Close", st.BufferBytes)
	}
}

// TestClose checks that Close waits for a prefetch in flight, releases the
// buffers, and that reads still work after it.
func TestClose(t *testing.T) {
	m := newMemReader(1<<20, 13)
	r := New(m, Options{MinWindow: 8 << 10, MaxWindow: 64 << 10})
	m.gate, m.gateAt = make(chan struct{}), 2000+8<<10
	_, next := startStream(t, r, m)
	closed := make(chan struct{})
	go func() {
		r.Close()
		close(closed)
	}()
	select {
	case <-closed:
		t.Fatal("Close returned while a prefetch was in flight")
	case <-time.After(50 * time.Millisecond):
	}
	close(m.gate)
	<-closed
	if st := r.Stats(); st.BufferBytes != 0 || st.Streams != 0 {
		t.Errorf("after Close: %d bytes of buffers, %d streams", st.BufferBytes, st.Streams)
	}
	before := r.Stats()
	calls := int64(0)
	for off := next; off < 100_000; off += 1000 {
		if err := diffRead(r, m.oracle(), off, 1000); err != nil {
			t.Fatal(err)
		}
		calls++
	}
	if st := r.Stats(); st.DirectReads-before.DirectReads != calls || st.BufferBytes != 0 {
		t.Errorf("after Close: %d of %d reads direct, %d bytes of buffers", st.DirectReads-before.DirectReads, calls, st.BufferBytes)
	}
	r.Close() // twice is fine
}

// TestIdle checks that a stream nobody reads is forgotten and its buffers
// released.
func TestIdle(t *testing.T) {
	m := newMemReader(1<<20, 14)
	r := New(m, Options{IdleTime: 10 * time.Millisecond})
	defer r.Close()
	for off := int64(0); off < 300_000; off += 20000 {
		if err := diffRead(r, m.oracle(), off, 20000); err != nil {
			t.Fatal(err)
		}
	}
	if st := r.Stats(); st.Streams != 1 || st.BufferBytes == 0 {
		t.Fatalf("after a scan: %d streams, %d bytes of buffers", st.Streams, st.BufferBytes)
	}
	deadline := time.Now().Add(5 * time.Second)
	for st := r.Stats(); st.Streams != 0 || st.BufferBytes != 0; st = r.Stats() {
		if time.Now().After(deadline) {
			t.Fatalf("idle for 5s: %d streams, %d bytes of buffers", st.Streams, st.BufferBytes)
		}
		time.Sleep(5 * time.Millisecond)
	}
	// A new scan starts a new stream.
	for off := int64(300_000); off < 600_000; off += 20000 {
		if err := diffRead(r, m.oracle(), off, 20000); err != nil {
			t.Fatal(err)
		}
	}
	if st := r.Stats(); st.Streams != 1 {
		t.Errorf("after another scan: %d streams", st.Streams)
	}
}

// TestHitAllocs checks that a read served from a window, and a random
// read, allocate nothing.
func TestHitAllocs(t *testing.T) {
	m := newMemReader(1<<20, 15)
	r := New(m, Options{})
	defer r.Close()
	p := make([]byte, 20000)
	for _, off := range []int64{0, 20000, 40000} { // a stream, window at 40000
		if _, err := r.ReadAt(p, off); err != nil {
			t.Fatal(err)
		}
	}
	before := r.Stats()
	// 101 small reads, less than half the window: no prefetch.
	if a := testing.AllocsPerRun(100, func() { r.ReadAt(p[:100], 70000) }); a != 0 {
		t.Errorf("a read from a window makes %v allocations", a)
	}
	if st := r.Stats(); st.Reads != before.Reads {
		t.Fatalf("the reads from a window made %d underlying reads", st.Reads-before.Reads)
	}
	if a := testing.AllocsPerRun(100, func() { r.ReadAt(p[:4096], 900_000) }); a != 0 {
		t.Errorf("a random read makes %v allocations", a)
	}
}
