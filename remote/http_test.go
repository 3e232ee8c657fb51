package remote

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/servers"
)

// TestHTTPReads compares reads through nginx with the file it serves:
// random offsets and lengths (chunk-crossing, tiny, past the end), the
// whole file in one read, and reads at and past the end.
func TestHTTPReads(t *testing.T) {
	const size = 3<<20 + 12345 // not a multiple of the chunk size
	ng, data := nginxWith(t, size, false)
	c := newClient(t, testOptions(nil))
	o := open(t, c, ng.URL+"/disk.img")
	if o.Size() != size {
		t.Fatalf("Size %d, want %d", o.Size(), size)
	}
	if o.Version() == "" {
		t.Errorf("no version (nginx sends an ETag)")
	}
	r := rand.New(rand.NewPCG(1, 2))
	within(t, 30*time.Second, "random reads", func() {
		for range 300 {
			off := r.Int64N(size + 100)
			n := 1 + r.IntN(300<<10)
			if r.IntN(4) == 0 {
				n = 1 + r.IntN(600)
			}
			p := make([]byte, n)
			got, err := o.ReadAt(p, off)
			want := max(0, min(int64(n), size-off))
			if int64(got) != want {
				t.Fatalf("ReadAt(%d, %d) = %d, %v; want %d bytes", n, off, got, err, want)
			}
			if want < int64(n) && err != io.EOF {
				t.Fatalf("ReadAt(%d, %d) short without io.EOF: %v", n, off, err)
			}
			if want == int64(n) && err != nil {
				t.Fatalf("ReadAt(%d, %d): %v", n, off, err)
			}
			if !bytes.Equal(p[:got], data[off:off+int64(got)]) {
				t.Fatalf("ReadAt(%d, %d): bytes differ from the file", n, off)
			}
		}
		whole := make([]byte, size)
		if n, err := o.ReadAt(whole, 0); n != size || (err != nil && err != io.EOF) {
			t.Fatalf("whole read: %d, %v", n, err)
		}
		if !bytes.Equal(whole, data) {
			t.Fatal("whole read differs from the file")
		}
	})
	st := o.Stats()
	if st.Hits == 0 || st.Misses == 0 || st.Requests == 0 {
		t.Errorf("stats %+v: want hits, misses and requests", st)
	}
}

// readAll reads o whole in reads of n bytes, in order.
func readAll(t testing.TB, o *Object, n int) []byte {
	t.Helper()
	out := make([]byte, o.Size())
	for off := int64(0); off < o.Size(); off += int64(n) {
		end := min(off+int64(n), o.Size())
		if _, err := o.ReadAt(out[off:end], off); err != nil && err != io.EOF {
			t.Fatalf("ReadAt(%d, %d): %v", end-off, off, err)
		}
	}
	return out
}

// TestHTTPS reads over TLS with the test CA given as CAFile, and checks
// that without it the certificate is refused at once, not retried until
// the timeout.
func TestHTTPS(t *testing.T) {
	ng, data := nginxWith(t, 1<<20+5, true)
	if !strings.HasPrefix(ng.URL, "https://") {
		t.Fatalf("nginx URL %s is not https", ng.URL)
	}
	o := testOptions(nil)
	o.CAFile = ng.CAFile
	obj := open(t, newClient(t, o), ng.URL+"/disk.img")
	if !bytes.Equal(readAll(t, obj, 100<<10), data) {
		t.Fatal("bytes over TLS differ from the file")
	}

	start := time.Now()
	_, err := newClient(t, testOptions(nil)).Open(context.Background(), ng.URL+"/disk.img")
	if err == nil || !strings.Contains(err.Error(), "certificate") || !strings.Contains(err.Error(), "--ca-file") {
		t.Fatalf("open without the CA: %v; want a certificate error that points at --ca-file", err)
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("a certificate error took %v: it must not be retried", d)
	}
}

// TestConcurrentReaders runs readers in parallel over a cache much
// smaller than the file (run with -race).
func TestConcurrentReaders(t *testing.T) {
	const size = 4 << 20
	ng, data := nginxWith(t, size, false)
	opts := testOptions(nil)
	opts.CacheSize = 16 * opts.ChunkSize // a quarter of the file
	c := newClient(t, opts)
	o := open(t, c, ng.URL+"/disk.img")
	within(t, 60*time.Second, "concurrent readers", func() {
		var wg sync.WaitGroup
		errs := make(chan error, 8)
		for g := range 8 {
			wg.Go(func() {
				r := rand.New(rand.NewPCG(uint64(g), 9))
				p := make([]byte, 200<<10)
				for range 60 {
					off := r.Int64N(size)
					n := min(1+r.IntN(len(p)), int(size-off))
					if g%2 == 0 { // half the readers are sequential
						off = int64(g) * (size / 8)
					}
					if _, err := o.ReadAt(p[:n], off); err != nil {
						errs <- fmt.Errorf("ReadAt(%d, %d): %w", n, off, err)
						return
					}
					if !bytes.Equal(p[:n], data[off:off+int64(n)]) {
						errs <- fmt.Errorf("ReadAt(%d, %d): bytes differ", n, off)
						return
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
	})
	if st := c.Stats(); st.CacheBuffers > 16 {
		t.Errorf("%d chunk buffers allocated with room for 16", st.CacheBuffers)
	}
}

// TestTinyCache reads with a cache of two chunks: every chunk is evicted
// again and again, readers in parallel find no free slot and read around
// the cache, and the bytes stay right.
func TestTinyCache(t *testing.T) {
	const size = 1<<20 + 999
	ng, data := nginxWith(t, size, false)
	opts := testOptions(nil)
	opts.CacheSize = 2 * opts.ChunkSize
	c := newClient(t, opts)
	o := open(t, c, ng.URL+"/disk.img")
	within(t, 30*time.Second, "reads through a tiny cache", func() {
		for range 2 {
			if !bytes.Equal(readAll(t, o, 48<<10), data) {
				t.Fatal("sequential reads through a tiny cache differ from the file")
			}
		}
		var wg sync.WaitGroup
		for g := range 4 {
			wg.Go(func() {
				r := rand.New(rand.NewPCG(uint64(g), 77))
				p := make([]byte, 300<<10) // spans 5 or 6 chunks: more than the cache
				for range 20 {
					off := r.Int64N(size - int64(len(p)))
					if _, err := o.ReadAt(p, off); err != nil {
						t.Errorf("ReadAt(%d, %d): %v", len(p), off, err)
						return
					}
					if !bytes.Equal(p, data[off:off+int64(len(p))]) {
						t.Errorf("ReadAt(%d, %d): bytes differ", len(p), off)
						return
					}
				}
			})
		}
		wg.Wait()
	})
	st := c.Stats()
	if st.CacheBuffers > 2 {
		t.Errorf("%d chunk buffers with room for 2", st.CacheBuffers)
	}
	if chunks := (size + opts.ChunkSize - 1) / opts.ChunkSize; st.Misses < 2*chunks {
		t.Errorf("%d misses reading %d chunks twice through 2 slots: nothing was evicted?", st.Misses, chunks)
	}
	if st.Direct == 0 {
		t.Errorf("no read went around the cache with 6-chunk reads through 2 slots: %+v", st.Stats)
	}
}

// TestEmptyObject opens a zero-byte file: no range to ask for, yet not a
// server ignoring Range.
func TestEmptyObject(t *testing.T) {
	root := t.TempDir()
	writeRandom(t, root, "empty.img", 0, 0)
	ng := servers.StartNginx(t, root, false)
	o := open(t, newClient(t, testOptions(nil)), ng.URL+"/empty.img")
	if o.Size() != 0 {
		t.Fatalf("Size %d", o.Size())
	}
	if n, err := o.ReadAt(make([]byte, 10), 0); n != 0 || err != io.EOF {
		t.Errorf("ReadAt = %d, %v; want 0, EOF", n, err)
	}
}
