package qcow2

import (
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"

	"github.com/klauspost/compress/zstd"
)

// TestZstdWindowBound: a zstd frame that declares a window far larger than
// a cluster (512 MiB, as a hostile image may) is refused, and decoding it
// in parallel allocates about what a cluster costs, not the window; a frame
// like qemu's (its window is its content, one cluster) decodes.
func TestZstdWindowBound(t *testing.T) {
	const cs = 64 << 10
	data := make([]byte, cs)
	r := rand.New(rand.NewPCG(1, 1))
	for i := range data {
		data[i] = byte(r.IntN(4)) // compressible
	}
	frame := func(opts ...zstd.EOption) []byte {
		enc, err := zstd.NewWriter(nil, opts...)
		if err != nil {
			t.Fatal(err)
		}
		defer enc.Close()
		return enc.EncodeAll(data, nil)
	}
	normal := frame()
	huge := frame(zstd.WithWindowSize(512<<20), zstd.WithSingleSegment(false))

	d := newDecompressor(compressionZstd, cs)
	dst := make([]byte, cs)
	if err := d.decompress(dst, normal); err != nil || string(dst) != string(data) {
		t.Fatalf("a frame of one cluster's window: %v", err)
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Go(func() {
			out := make([]byte, cs)
			for range 4 {
				errs[i] = d.decompress(out, huge)
			}
		})
	}
	wg.Wait()
	runtime.ReadMemStats(&after)
	for _, err := range errs {
		if err == nil {
			t.Fatal("a frame declaring a 512 MiB window was decoded")
		}
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > 64*cs {
		t.Errorf("8 readers of hostile frames allocated %d bytes (%d clusters)", got, got/cs)
	}
}
