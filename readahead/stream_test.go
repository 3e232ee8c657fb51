package readahead

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"
)

// TestCompressedScan reads a simulated compressed image sequentially, by
// one or several workers taking consecutive clusters, and checks that the
// bytes are right, that the window grows to MaxWindow and that the calls
// cost far fewer underlying reads than calls.
func TestCompressedScan(t *testing.T) {
	const size = 64 << 20
	for _, tc := range []struct {
		name    string
		workers int
	}{
		{"sequential", 1},
		{"2 workers", 2},
		{"4 workers", 4},
		{"16 workers", 16},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := newMemReader(size, 3)
			r := New(m, Options{})
			defer r.Close()
			cs := clusters(size, 3)
			var next sync.Mutex
			i := 0
			var wg sync.WaitGroup
			for range tc.workers {
				wg.Go(func() {
					for {
						next.Lock()
						if i == len(cs) {
							next.Unlock()
							return
						}
						c := cs[i]
						i++
						next.Unlock()
						if err := diffRead(r, m.oracle(), c.off, int(c.n)); err != nil {
							t.Error(err)
							return
						}
					}
				})
			}
			wg.Wait()
			settle(r)
			st := r.Stats()
			perCall := float64(st.Reads) / float64(st.Calls)
			t.Logf("%d clusters: %d underlying reads (%.4f per cluster, %d direct, %d prefetched, %d waits), %d bytes read for %d",
				len(cs), st.Reads, perCall, st.DirectReads, st.Prefetches, st.Waits, st.ReadBytes, int64(size))
			if perCall >= 0.1 {
				t.Errorf("%.3f underlying reads per call, want < 0.1", perCall)
			}
			if m.maxLen != DefaultMaxWindow {
				t.Errorf("the largest underlying read is %d bytes, want the window to grow to %d", m.maxLen, DefaultMaxWindow)
			}
			// Windows are contiguous: little is read twice (the first
			// cluster, reads that lost a race to their neighbours) and
			// little past the end.
			if st.ReadBytes > size+2*DefaultMaxWindow {
				t.Errorf("read %d bytes for a %d-byte scan", st.ReadBytes, int64(size))
			}
			if st.PeakBufferBytes > st.BufferLimit {
				t.Errorf("peak buffers %d > limit %d", st.PeakBufferBytes, st.BufferLimit)
			}
		})
	}
}

// TestWindowGrowth follows the underlying reads of one sequential stream:
// the reads before the stream starts are the callers' own; then each
// prefetched window doubles until MaxWindow, and none overlaps another.
func TestWindowGrowth(t *testing.T) {
	m := newMemReader(1<<20, 4)
	r := New(m, Options{MinWindow: 4 << 10, MaxWindow: 64 << 10})
	defer r.Close()
	for off := int64(0); off < 1<<20; off += 1000 {
		if err := diffRead(r, m.oracle(), off, 1000); err != nil {
			t.Fatal(err)
		}
	}
	settle(r)
	log := m.calls()
	for i, want := range []span{{0, 1000}, {1000, 1000}, {2000, 4 << 10}} {
		if log[i] != want {
			t.Fatalf("underlying read %d is %v, want %v", i, log[i], want)
		}
	}
	want := int64(4 << 10)
	for i := 3; i < len(log); i++ {
		c, prev := log[i], log[i-1]
		want = min(2*want, 64<<10)
		if c.off != prev.off+prev.n {
			t.Errorf("window %d at %d, want it right after the previous one at %d", i, c.off, prev.off+prev.n)
		}
		if c.n != want {
			t.Errorf("window %d is %d bytes, want %d", i, c.n, want)
		}
	}
}

// TestRandomReads checks that reads far from each other cost exactly one
// underlying read of exactly the bytes asked for, allocate no buffer, and
// leave an existing stream's windows alone.
func TestRandomReads(t *testing.T) {
	const size = 64 << 20
	for _, n := range []int{1, 512, 4096, 65536, 1 << 20} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			m := newMemReader(size, 5)
			r := New(m, Options{})
			defer r.Close()

			// A sequential stream over the first MiBs.
			off := int64(0)
			for ; off < 2<<20; off += 20000 {
				if err := diffRead(r, m.oracle(), off, 20000); err != nil {
					t.Fatal(err)
				}
			}
			settle(r)
			before := r.Stats()

			// Random reads, one per MiB slot of [16 MiB, 62 MiB) in a random
			// order, at least 512 KiB apart.
			rng := rand.New(rand.NewPCG(uint64(n), 5))
			for _, slot := range rng.Perm(46) {
				o := int64(16+slot)<<20 + rng.Int64N(512<<10)
				st0 := r.Stats()
				if err := diffRead(r, m.oracle(), o, n); err != nil {
					t.Fatal(err)
				}
				st := r.Stats()
				if st.Reads-st0.Reads != 1 || st.ReadBytes-st0.ReadBytes != int64(n) {
					t.Fatalf("a random read of %d bytes cost %d underlying reads of %d bytes, want 1 of %d",
						n, st.Reads-st0.Reads, st.ReadBytes-st0.ReadBytes, n)
				}
				if st.BufferBytes != before.BufferBytes || st.PeakBufferBytes != before.PeakBufferBytes {
					t.Fatalf("a random read changed the buffers in use from %d to %d", before.BufferBytes, st.BufferBytes)
				}
			}

			// The stream's window survived: its next read is a hit.
			st0 := r.Stats()
			if err := diffRead(r, m.oracle(), off, 20000); err != nil {
				t.Fatal(err)
			}
			if st := r.Stats(); st.Reads != st0.Reads && st.Reads-st0.Reads != st.Prefetches-st0.Prefetches {
				t.Errorf("the stream's next read cost %d underlying reads after random reads", st.Reads-st0.Reads)
			}
		})
	}
}

// TestInterleavedStreams interleaves sequential readers of separate regions
// in one goroutine: up to MaxStreams of them each keep their windows, and
// more do not thrash them.
func TestInterleavedStreams(t *testing.T) {
	const region = 4 << 20
	for _, tc := range []struct {
		streams int
	}{{1}, {2}, {4}, {8}, {9}, {12}, {32}, {40}} {
		t.Run(fmt.Sprint(tc.streams), func(t *testing.T) {
			m := newMemReader(tc.streams*region, 6)
			r := New(m, Options{})
			defer r.Close()
			for i := int64(0); i*20000 < region-20000; i++ {
				for s := range int64(tc.streams) {
					if err := diffRead(r, m.oracle(), s*region+i*20000, 20000); err != nil {
						t.Fatal(err)
					}
				}
			}
			st := r.Stats()
			perCall := float64(st.Reads) / float64(st.Calls)
			t.Logf("%d streams: %.4f underlying reads per call, %d bytes read, peak buffers %d",
				tc.streams, perCall, st.ReadBytes, st.PeakBufferBytes)
			// Past MaxStreams, the streams without a slot are read
			// directly: they must not steal slots and fetch windows they
			// do not get to read.
			// Past 4*MaxStreams, the Reader forgets a stream's last read
			// before its next one: all reads are direct, none costs more.
			want := 0.1
			if tc.streams > 4*DefaultMaxStreams {
				want = 1.0001
			} else if extra := tc.streams - DefaultMaxStreams; extra > 0 {
				want = float64(extra)/float64(tc.streams) + 0.05
			}
			if perCall >= want {
				t.Errorf("%.3f underlying reads per call, want < %.3f", perCall, want)
			}
			// Each stream reads ahead by at most two windows past its end.
			if asked := st.Calls * 20000; st.ReadBytes > asked+int64(tc.streams)*2*DefaultMaxWindow {
				t.Errorf("read %d bytes for %d asked", st.ReadBytes, asked)
			}
			if st.Streams > DefaultMaxStreams {
				t.Errorf("%d streams tracked, want at most %d", st.Streams, DefaultMaxStreams)
			}
		})
	}
}

// startStream starts a stream on r and has it prefetch its second window:
// three adjacent reads from 0 (the third starts the stream, with a window of
// MinWindow bytes at 2000), then a read taking it to half of that window.
// It returns where the prefetched window starts and where the stream's next
// read is.
func startStream(t *testing.T, r *Reader, m *memReader) (prefetched, next int64) {
	t.Helper()
	win := int64(r.opts.MinWindow)
	for _, rd := range []span{{0, 1000}, {1000, 1000}, {2000, 1000}, {3000, win / 2}} {
		if err := diffRead(r, m.oracle(), rd.off, int(rd.n)); err != nil {
			t.Fatal(err)
		}
	}
	return 2000 + win, 3000 + win/2
}

// TestPrefetch checks that reading half of a window fetches the next one
// in the background: reading it afterwards costs nothing.
func TestPrefetch(t *testing.T) {
	m := newMemReader(1<<20, 11)
	r := New(m, Options{MinWindow: 8 << 10, MaxWindow: 64 << 10})
	defer r.Close()
	second, next := startStream(t, r, m)
	settle(r)
	st := r.Stats()
	if st.Reads != 4 || st.Prefetches != 1 {
		t.Fatalf("%d underlying reads, %d prefetches after reading half of the first window, want 4, 1 (%v)",
			st.Reads, st.Prefetches, m.calls())
	}
	if last := m.calls()[3]; last != (span{second, 16 << 10}) {
		t.Fatalf("prefetched %v, want the 16 KiB after the first window", last)
	}
	// The rest of the first window and less than half of the second.
	for off := next; off+1000 < second+8<<10; off += 1000 {
		if err := diffRead(r, m.oracle(), off, 1000); err != nil {
			t.Fatal(err)
		}
	}
	if st2 := r.Stats(); st2.Reads != st.Reads {
		t.Errorf("reading prefetched bytes cost %d more underlying reads", st2.Reads-st.Reads)
	}
}

// TestFetchOnce has many readers want bytes of a window whose prefetch is
// blocked: they all wait for it, and the bytes are read once.
func TestFetchOnce(t *testing.T) {
	m := newMemReader(1<<20, 12)
	r := New(m, Options{MinWindow: 8 << 10, MaxWindow: 64 << 10})
	defer r.Close()
	m.gate, m.gateAt = make(chan struct{}), 2000+8<<10
	second, _ := startStream(t, r, m)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			if err := diffRead(r, m.oracle(), second+int64(g)*1000, 1000); err != nil {
				t.Error(err)
			}
		})
	}
	deadline := time.Now().Add(5 * time.Second)
	for r.Stats().Waits < 8 {
		if time.Now().After(deadline) {
			close(m.gate)
			t.Fatalf("readers of a window being fetched did not wait for it: %+v", r.Stats())
		}
		time.Sleep(time.Millisecond)
	}
	close(m.gate)
	wg.Wait()
	if st := r.Stats(); st.Reads != 4 {
		t.Errorf("%d underlying reads (%v), want 4: two direct, the first window, the prefetch", st.Reads, m.calls())
	}
}
