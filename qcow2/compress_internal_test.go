package qcow2

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"math/rand/v2"
	"runtime"
	"strings"
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

// TestZstdFastFrame: the frames zstdFastFrame hands to libzstd are those
// whose header, as klauspost's decoder reads it, declares no dictionary, a
// content size of one cluster and a window within the bound; checked on
// random headers (every descriptor, window byte and content-size field).
func TestZstdFastFrame(t *testing.T) {
	const cs, window = 64 << 10, 2 << 20
	r := rand.New(rand.NewPCG(2, 2))
	fast := 0
	for range 100000 {
		// A header field by field: the descriptor (content-size flag,
		// single segment, reserved bit, dictionary-ID flag), a window
		// byte, a dictionary ID (often 0), a content size (often one
		// cluster, near it, or random) in the width the flag says;
		// sometimes cut short.
		desc := byte(r.IntN(4))<<6 | byte(r.IntN(2))<<5 | byte(r.IntN(4))
		if r.IntN(20) == 0 {
			desc |= 0x08
		}
		b := binary.LittleEndian.AppendUint32(nil, 0xFD2FB528)
		b = append(b, desc)
		if desc&0x20 == 0 {
			b = append(b, byte(r.IntN(256)))
		}
		for range [4]int{0, 1, 2, 4}[desc&3] {
			b = append(b, byte(r.IntN(256)*r.IntN(2)))
		}
		fcs := []uint64{cs, cs, cs - 256, cs + 1, 255, r.Uint64()}[r.IntN(6)]
		switch desc >> 6 {
		case 0:
			if desc&0x20 != 0 {
				b = append(b, byte(fcs))
			}
		case 1:
			b = binary.LittleEndian.AppendUint16(b, uint16(fcs-256))
		case 2:
			b = binary.LittleEndian.AppendUint32(b, uint32(fcs))
		case 3:
			b = binary.LittleEndian.AppendUint64(b, fcs)
		}
		b = append(b, 0, 0, 0)
		if r.IntN(10) == 0 {
			b = b[:4+r.IntN(len(b)-4)]
		}
		var h zstd.Header
		err := h.Decode(b)
		win := h.WindowSize
		if h.SingleSegment {
			win = h.FrameContentSize
		}
		want := err == nil && h.HasFCS && h.FrameContentSize == cs && h.DictionaryID == 0 && win <= window
		if got := zstdFastFrame(b, cs, window); got != want {
			t.Fatalf("header % x: zstdFastFrame %v; klauspost's header %+v (%v) says %v", b, got, h, err, want)
		}
		if want {
			fast++
		}
	}
	if fast == 0 {
		t.Fatal("no random header was a fast frame: the test checks nothing")
	}
	t.Logf("%d fast headers", fast)
}

// TestZstdPathsAgree: frames the fast path must not take (content longer
// or shorter than a cluster, a frame followed by another) decode as
// klauspost's stream decoder decodes them, which stops at a full cluster
// whatever follows, as qemu's stream decoding does; and frames with
// bytes changed decode to the stream decoder's bytes wherever both decode.
func TestZstdPathsAgree(t *testing.T) {
	const cs = 64 << 10
	r := rand.New(rand.NewPCG(3, 3))
	data := make([]byte, 3*cs)
	for i := range data {
		data[i] = byte(r.IntN(8))
	}
	enc, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedDefault))
	if err != nil {
		t.Fatal(err)
	}
	defer enc.Close()
	one := enc.EncodeAll(data[:cs], nil)
	if !zstdFastFrame(one, cs, maxZstdWindow) {
		t.Fatalf("a frame of one cluster (header % x) is not a fast frame", one[:8])
	}
	if haveLibzstd {
		out := make([]byte, cs)
		if err := newZstdDecoder().decode(out, one); err != nil || string(out) != string(data[:cs]) {
			t.Fatalf("libzstd on a frame of one cluster: %v", err)
		}
	}
	frames := map[string][]byte{
		"one cluster":                  one,
		"one cluster, then garbage":    append(append([]byte(nil), one...), 0xff, 0x00, 0x28, 0xb5),
		"two clusters":                 enc.EncodeAll(data[:2*cs], nil),
		"half a cluster":               enc.EncodeAll(data[:cs/2], nil),
		"half, then the other half":    append(enc.EncodeAll(data[:cs/2], nil), enc.EncodeAll(data[cs/2:cs], nil)...),
		"a third, then two clusters":   append(enc.EncodeAll(data[:cs/3], nil), enc.EncodeAll(data[cs/3:2*cs], nil)...),
		"one cluster, cut short":       one[:len(one)-5],
		"one cluster, a byte too many": enc.EncodeAll(data[:cs+1], nil),
	}
	for i := range 300 {
		b := append([]byte(nil), one...)
		for range 1 + r.IntN(3) {
			b[6+r.IntN(len(b)-6)] ^= byte(1 + r.IntN(255))
		}
		frames[fmt.Sprintf("changed %d", i)] = b
	}
	stream, err := zstd.NewReader(nil, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxWindow(maxZstdWindow))
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	d := newDecompressor(compressionZstd, cs)
	got, want := make([]byte, cs), make([]byte, cs)
	differ := 0
	for name, f := range frames {
		clear(got)
		clear(want)
		gerr := d.decompress(got, f)
		werr := stream.Reset(bytes.NewReader(f))
		if werr == nil {
			_, werr = io.ReadFull(stream, want)
		}
		switch {
		case gerr == nil && werr == nil:
			if !bytes.Equal(got, want) {
				t.Errorf("%s: the bytes differ from the stream decoder's", name)
			}
		case (gerr == nil) != (werr == nil):
			if !strings.HasPrefix(name, "changed") {
				t.Errorf("%s: decompress %v, the stream decoder %v", name, gerr, werr)
			}
			differ++ // libzstd (qemu's decoder) and klauspost disagree on a damaged frame
		}
	}
	t.Logf("%d damaged frames one decoder accepts and the other refuses", differ)
}
