package fiemap

import (
	"fmt"
	"io"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

// TestConcurrent runs many goroutines querying one Map whose cache is too
// small for the file, so hits, misses and evictions interleave; every
// answer is checked against the kernel's, taken beforehand. Run with -race.
func TestConcurrent(t *testing.T) {
	forEachFS(t, func(t *testing.T, dir string, typ int64) {
		f := makeFile(t, dir, "f", steps(fragment(600, 4096, 8192), fallocate(0, 600*8192, 1<<20),
			write(600*8192+12345, 100)))
		k := newKernel(t, f)
		type answer struct {
			off, data, hole  int64
			dataEOF, holeEOF bool
		}
		var answers []answer
		for _, off := range probes(k.size, k.walk(t), 400, 1) {
			d, derr := k.next(t, off, unix.SEEK_DATA)
			h, herr := k.next(t, off, unix.SEEK_HOLE)
			answers = append(answers, answer{off, d, h, derr == io.EOF, herr == io.EOF})
		}
		for _, c := range configs {
			t.Run(c.name, func(t *testing.T) {
				// Small windows and cache, whatever the config, so
				// that evictions happen under concurrency.
				opt := &Options{WindowExtents: 8, CacheExtents: 20}
				if c.opt != nil {
					opt.Sync = c.opt.Sync
					if c.opt.WindowExtents != 0 {
						opt = c.opt
					}
				}
				m := newMap(t, f, opt, c.method)
				var wg sync.WaitGroup
				for g := range 8 {
					wg.Go(func() {
						rng := rand.New(rand.NewPCG(uint64(g), 2))
						for range 3000 {
							a := answers[rng.IntN(len(answers))]
							d, derr := m.NextData(a.off)
							h, herr := m.NextHole(a.off)
							if d != a.data || (derr == io.EOF) != a.dataEOF || (derr != nil && derr != io.EOF) {
								t.Errorf("NextData(%d) = %d, %v; kernel says %d (EOF %v)", a.off, d, derr, a.data, a.dataEOF)
								return
							}
							if h != a.hole || (herr == io.EOF) != a.holeEOF || (herr != nil && herr != io.EOF) {
								t.Errorf("NextHole(%d) = %d, %v; kernel says %d (EOF %v)", a.off, h, herr, a.hole, a.holeEOF)
								return
							}
						}
					})
				}
				wg.Wait()
				st := m.Stats()
				t.Logf("%+v", st)
				if st.Evictions == 0 {
					t.Errorf("no evictions: the test does not exercise them")
				}
				checkBudget(t, m)
			})
		}
	})
}

// TestOneFillPerRegion starts many goroutines on the same cold region at
// once: the host is asked once, not once per goroutine.
func TestOneFillPerRegion(t *testing.T) {
	forEachFS(t, func(t *testing.T, dir string, typ int64) {
		f := makeFile(t, dir, "f", steps(truncate(64<<20), write(1<<20, 4096), write(40<<20, 4096)))
		for name, method := range map[string]Method{"auto": MethodUnknown, "lseek": MethodLseek} {
			t.Run(name, func(t *testing.T) {
				m := newMap(t, f, nil, method)
				start := make(chan struct{})
				var wg sync.WaitGroup
				for range 16 {
					wg.Go(func() {
						<-start
						if d, err := m.NextData(0); err != nil || d != 1<<20 {
							t.Errorf("NextData(0) = %d, %v", d, err)
						}
					})
				}
				close(start)
				wg.Wait()
				if st := m.Stats(); st.Fills != 1 {
					t.Errorf("%d fills for one region, want 1: %+v", st.Fills, st)
				}
			})
		}
	})
}

// TestSecondWalkFree checks the cache: walking a file again, forwards or
// backwards, makes no host call, and the first walk costs one FIEMAP call
// per WindowExtents extents (where FIEMAP works).
func TestSecondWalkFree(t *testing.T) {
	forEachFS(t, func(t *testing.T, dir string, typ int64) {
		f := makeFile(t, dir, "f", steps(fragment(1000, 4096, 8192), fsync))
		m := newMap(t, f, &Options{WindowExtents: 100}, MethodUnknown)
		runs := walk(t, m)
		first := m.Stats()
		t.Logf("first walk of %d extents: %+v", len(runs), first)
		if first.Method == MethodFiemap && first.HostCalls() > int64(len(runs)/100+2) {
			t.Errorf("first walk: %d host calls for %d extents at 100 per call", first.HostCalls(), len(runs))
		}
		if again := walk(t, m); !slices.Equal(again, runs) {
			t.Fatalf("second walk differs")
		}
		for i := len(runs) - 1; i >= 0; i-- {
			if h, err := m.NextHole(runs[i].start); err != nil || h != runs[i].end {
				t.Fatalf("NextHole(%d) = %d, %v; want %d", runs[i].start, h, err, runs[i].end)
			}
		}
		if st := m.Stats(); st.HostCalls() != first.HostCalls() || st.Fills != first.Fills {
			t.Errorf("second walk made %d host calls", st.HostCalls()-first.HostCalls())
		}
	})
}

// TestEviction walks a file much larger than the cache: the budget holds
// throughout, and windows queried again survive a sweep (CLOCK).
func TestEviction(t *testing.T) {
	forEachFS(t, func(t *testing.T, dir string, typ int64) {
		f := makeFile(t, dir, "f", fragment(2000, 4096, 8192))
		want := newKernel(t, f).walk(t)
		opt := &Options{WindowExtents: 16, CacheExtents: 64}
		m := newMap(t, f, opt, MethodUnknown)
		hot := want[0].start
		for off := int64(0); ; {
			d, err := m.NextData(off)
			if err == io.EOF {
				break
			}
			h, err := m.NextHole(d)
			if err != nil {
				t.Fatal(err)
			}
			off = h
			checkBudget(t, m)
			if _, err := m.NextData(hot); err != nil { // keep the first window hot
				t.Fatal(err)
			}
		}
		st := m.Stats()
		t.Logf("%+v", st)
		if st.Evictions == 0 {
			t.Fatalf("no evictions")
		}
		if _, err := m.NextData(hot); err != nil {
			t.Fatal(err)
		}
		if again := m.Stats(); again.Fills != st.Fills {
			t.Errorf("the hot window was evicted")
		}
		if got := walk(t, m); !slices.Equal(got, want) {
			t.Errorf("walk after evictions differs from the kernel's")
		}
	})
}

// TestHugeSparse maps a 1 TiB file with a few hundred islands of data:
// the walk matches the kernel's, costs few host calls with FIEMAP, and the
// memory used does not grow with the file's size.
func TestHugeSparse(t *testing.T) {
	forEachFS(t, func(t *testing.T, dir string, typ int64) {
		const size = 1 << 40
		var s []step
		rng := rand.New(rand.NewPCG(7, 7))
		for range 200 {
			s = append(s, write(rng.Int64N(size-8192), 1+rng.Int64N(8192)))
		}
		f := makeFile(t, dir, "huge", steps(append(s, truncate(size))...))
		want := newKernel(t, f).walk(t)
		for _, opt := range []*Options{nil, {WindowExtents: 4, CacheExtents: 16}} {
			t.Run(fmt.Sprintf("%+v", opt), func(t *testing.T) {
				var before, after runtime.MemStats
				runtime.ReadMemStats(&before)
				m := newMap(t, f, opt, MethodUnknown)
				got := walk(t, m)
				runtime.ReadMemStats(&after)
				if !slices.Equal(got, want) {
					t.Fatalf("walk:\n got %v\nwant %v", clipRuns(got), clipRuns(want))
				}
				st := m.Stats()
				alloc := after.TotalAlloc - before.TotalAlloc
				t.Logf("%d extents, %d bytes allocated (walk result included): %+v", len(want), alloc, st)
				if alloc > 1<<20 {
					t.Errorf("walking a 1 TiB file allocated %d bytes", alloc)
				}
				checkBudget(t, m)
				if st.Method == MethodFiemap && opt == nil && st.HostCalls() > 4 {
					t.Errorf("%d host calls to walk %d extents", st.HostCalls(), len(want))
				}
			})
		}
	})
}
