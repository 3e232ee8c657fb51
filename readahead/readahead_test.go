package readahead

import (
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

// small are options under which test data spans many windows.
var small = Options{MinWindow: 4 << 10, MaxWindow: 16 << 10, MaxStreams: 4}

// scan returns up to count reads of n bytes, the first at start, each next
// one step bytes further (step may be negative), stopping past [0, size).
func scan(start, step int64, n, count int, size int64) []span {
	var rs []span
	for off := start; off >= 0 && off <= size && len(rs) < count; off += step {
		rs = append(rs, span{off, int64(n)})
	}
	return rs
}

// TestReadAtExact compares every read of a set of access patterns, for many
// sizes and alignments, with the underlying reader's own answer: the bytes,
// the count and the error, across window boundaries, at and past the end of
// the data, and with readers that return io.EOF early or not.
func TestReadAtExact(t *testing.T) {
	const size = 100_003 // odd, so windows never line up with the end
	lengths := []int{1, 7, 511, 512, 513, 4095, 4096, 4097, 6001, 8192, 16384, 16385, 40000}
	patterns := []struct {
		name  string
		reads func(n int) []span
	}{
		{"forward", func(n int) []span {
			return append(scan(0, int64(n), n, 400, size), scan(size-int64(50*n)-3, int64(n), n, 400, size)...)
		}},
		{"overlapping", func(n int) []span { // each read starts before the previous one ends
			step := int64(n - min(n-1, 300))
			return append(scan(5, step, n, 400, size), scan(size-int64(50*n)-1, step, n, 400, size)...)
		}},
		{"small gaps", func(n int) []span { // within MinWindow/2: still the same stream
			return scan(3, int64(n)+1000, n, 400, size)
		}},
		{"strided", func(n int) []span { // too far apart to be a stream
			return scan(11, int64(n)+5000, n, 400, size)
		}},
		{"backward", func(n int) []span {
			return scan(size-int64(n)+1, -int64(n), n, 400, size)
		}},
		{"end of data", func(n int) []span {
			var rs []span
			for _, off := range []int64{size - int64(n) - 1, size - int64(n), size - int64(n) + 1, size - 1, size, size + 1, size + 5000} {
				rs = append(rs, span{max(off, 0), int64(n)})
			}
			// The same again, now that a stream may know where the data ends.
			return append(append(scan(size-int64(3*n)-9, int64(n), n, 10, size), rs...), rs...)
		}},
	}
	for _, opts := range []struct {
		name string
		o    Options
	}{{"small", small}, {"default", Options{}}} {
		for _, eager := range []bool{false, true} {
			for _, pat := range patterns {
				name := fmt.Sprintf("%s/%s/eagerEOF=%v", opts.name, pat.name, eager)
				t.Run(name, func(t *testing.T) {
					for _, n := range lengths {
						m := newMemReader(size, 1)
						m.eagerEOF = eager
						r := New(m, opts.o)
						for _, rd := range pat.reads(n) {
							if err := diffRead(r, m.oracle(), rd.off, int(rd.n)); err != nil {
								t.Fatalf("reads of %d bytes: %v", n, err)
							}
						}
						r.Close()
						if st := r.Stats(); st.BufferBytes != 0 {
							t.Errorf("reads of %d bytes: %d bytes of buffers in use after Close", n, st.BufferBytes)
						}
					}
				})
			}
		}
	}
}

// TestOddReads covers reads ReadAt passes straight through: empty, at a
// negative offset, longer than MaxWindow, and near the largest offset.
func TestOddReads(t *testing.T) {
	m := newMemReader(50_000, 2)
	r := New(m, small)
	defer r.Close()
	for _, rd := range []span{{0, 0}, {100, 0}, {-1, 10}, {0, 16<<10 + 1}, {1 << 62, 10}, {1<<63 - 5, 10}} {
		if err := diffRead(r, m.oracle(), rd.off, int(rd.n)); err != nil {
			t.Error(err)
		}
	}
}

// TestErrors checks that an underlying error reaches exactly the callers
// whose own range it affects, with the bytes before it, and that reads work
// again after it.
func TestErrors(t *testing.T) {
	const size = 1 << 20
	for _, tc := range []struct {
		name string
		bad  span // unreadable bytes, sure to fall in some window
		read int  // length of the scan's reads
		step int  // offset from one read to the next
	}{
		{"bad sector in a prefetch", span{300_000, 512}, 20000, 20000},
		{"bad sector at a window start", span{4 << 10, 512}, 1000, 1000},
		{"bad byte, overlapping reads", span{77_777, 1}, 5000, 4700},
		{"bad range over windows", span{100_000, 200_000}, 7000, 7000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := newMemReader(size, 8)
			m.bad = tc.bad
			r := New(m, Options{MinWindow: 4 << 10, MaxWindow: 256 << 10})
			defer r.Close()
			failed := 0
			for pass := range 2 { // twice: the second pass reads after errors
				for off := int64(0); off < size; off += int64(tc.step) {
					if err := diffRead(r, m.oracle(), off, tc.read); err != nil {
						t.Fatalf("pass %d: %v", pass, err)
					}
					if off < tc.bad.off+tc.bad.n && off+int64(tc.read) > tc.bad.off {
						failed++
					}
				}
			}
			if failed == 0 {
				t.Fatal("no read met the bad bytes")
			}
		})
	}

	// Transient failures: a few underlying calls fail, wherever they are
	// (a window fetch, a prefetch, a direct read). A caller sees the error
	// only if its own direct re-read failed too; everything else is right,
	// and once the failures stop every read works.
	t.Run("transient", func(t *testing.T) {
		m := newMemReader(size, 9)
		r := New(m, Options{MinWindow: 4 << 10, MaxWindow: 64 << 10})
		defer r.Close()
		errs := 0
		for off := int64(0); off < size; off += 3000 {
			if off%100_000 < 3000 {
				m.failNext.Store(2)
			}
			p := make([]byte, 3000)
			n, err := r.ReadAt(p, off)
			switch {
			case errors.Is(err, errTransient):
				errs++
			case err != nil && err != io.EOF:
				t.Fatalf("ReadAt at %d: %v", off, err)
			default:
				if string(p[:n]) != string(m.data[off:off+int64(n)]) {
					t.Fatalf("ReadAt at %d: wrong bytes", off)
				}
			}
		}
		t.Logf("%d reads failed", errs)
		m.failNext.Store(0)
		for off := int64(0); off < size; off += 3000 {
			if err := diffRead(r, m.oracle(), off, 3000); err != nil {
				t.Fatal(err)
			}
		}
	})
}

// TestConcurrent has many goroutines share one Reader, some scanning
// (several of them the same region), some reading at random, some asking
// for Stats. Run it with -race.
func TestConcurrent(t *testing.T) {
	const size = 16 << 20
	for _, tc := range []struct {
		name string
		opts Options
	}{
		{"few slots", Options{MinWindow: 4 << 10, MaxWindow: 64 << 10, MaxStreams: 3}},
		{"small windows", Options{MinWindow: 4 << 10, MaxWindow: 256 << 10}},
		{"default", Options{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := newMemReader(size, 7)
			m.eagerEOF = true
			r := New(m, tc.opts)
			defer r.Close()
			var wg sync.WaitGroup
			for g := range 16 {
				wg.Go(func() {
					rng := rand.New(rand.NewPCG(uint64(g), 7))
					switch g % 4 {
					case 0, 1: // a compressed-style scan of a region, to the end of the data
						start := int64(g%8) * (size / 8)
						for _, c := range clusters(size-start, uint64(g)) {
							if err := diffRead(r, m.oracle(), start+c.off, int(c.n)); err != nil {
								t.Error(err)
								return
							}
						}
					case 2: // random reads of any size
						for range 2000 {
							if err := diffRead(r, m.oracle(), rng.Int64N(size+1000), 1+rng.IntN(70000)); err != nil {
								t.Error(err)
								return
							}
						}
					case 3: // short runs of sequential reads at random places
						for range 200 {
							off, n := rng.Int64N(size), 1+rng.IntN(30000)
							for range 10 {
								if err := diffRead(r, m.oracle(), off, n); err != nil {
									t.Error(err)
									return
								}
								off += int64(n)
							}
							_ = r.Stats()
						}
					}
				})
			}
			wg.Wait()
			settle(r)
			st := r.Stats()
			t.Logf("%+v", st)
			if st.PeakBufferBytes > st.BufferLimit {
				t.Errorf("peak buffers %d > limit %d", st.PeakBufferBytes, st.BufferLimit)
			}
			r.Close()
			if st := r.Stats(); st.BufferBytes != 0 {
				t.Errorf("%d bytes of buffers in use after Close", st.BufferBytes)
			}
		})
	}
}

// TestFile reads a real file through a Reader, the file being the oracle.
func TestFile(t *testing.T) {
	const size = 3<<20 + 123
	path := filepath.Join(t.TempDir(), "data")
	if err := os.WriteFile(path, randomData(size, 16), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r := New(f, Options{MinWindow: 16 << 10, MaxWindow: 256 << 10})
	defer r.Close()
	reads := append([]span{}, clusters(size, 16)...)
	reads = append(reads, scan(size-100_000, 4096, 4096, 100, size)...)
	rng := rand.New(rand.NewPCG(16, 16))
	for range 500 {
		reads = append(reads, span{rng.Int64N(size + 100), 1 + rng.Int64N(50000)})
	}
	for _, rd := range reads {
		if err := diffRead(r, f, rd.off, int(rd.n)); err != nil {
			t.Fatal(err)
		}
	}
	st := r.Stats()
	t.Logf("%+v", st)
}
