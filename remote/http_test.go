package remote

import (
	"bytes"
	"io"
	"math/rand/v2"
	"testing"
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
	within(t, 30e9, "random reads", func() {
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
