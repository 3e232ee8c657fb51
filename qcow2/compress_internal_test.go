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
// in parallel allocates about what a cluster costs, not the window; frames
// like qemu's (its window is its content, one cluster) and others'
// (twice the content) decode.
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
	// The encoder declares twice the content as the window; the window
	// descriptor (byte 5, after the magic and the frame header
	// descriptor) is set to 2^(10+19) = 512 MiB by hand.
	wide := frame(zstd.WithWindowSize(512<<20), zstd.WithSingleSegment(false))
	huge := append([]byte(nil), wide...)
	huge[5] = 19 << 3
	var h zstd.Header
	if err := h.Decode(huge); err != nil || h.WindowSize != 512<<20 {
		t.Fatalf("the hostile frame's header: %v %+v", err, h)
	}

	d := newDecompressor(compressionZstd, cs)
	dst := make([]byte, cs)
	for _, f := range [][]byte{normal, wide} {
		clear(dst)
		if err := d.decompress(dst, f); err != nil || string(dst) != string(data) {
			t.Fatalf("a frame of a %d-byte window: %v", declaredWindow(t, f), err)
		}
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

func declaredWindow(t *testing.T, f []byte) uint64 {
	var h zstd.Header
	if err := h.Decode(f); err != nil {
		t.Fatal(err)
	}
	return h.WindowSize
}
