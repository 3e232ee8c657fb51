package hostile

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"

	"github.com/klauspost/compress/zstd"
	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestZstdHugeWindow: a zstd image whose compressed clusters are frames
// declaring a 512 MiB window (re-encoded from qemu's own, so that each still
// decodes to its cluster with enough memory) is read by 8 parallel
// readers: each read fails with EIO (a frame may need no more than a
// cluster), and the daemon's peak memory stays within its caches and a
// fixed margin. Other images of the mount read on.
func TestZstdHugeWindow(t *testing.T) {
	harness.RequireFUSE(t)
	src := t.TempDir()
	raw := filepath.Join(src, "data.bin")
	qemu.Create(t, "raw", raw, "4M")
	qemu.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x5a 0 4M", raw)
	p := filepath.Join(src, "huge.qcow2")
	qemu.Img(t, "convert", "-c", "-O", "qcow2", "-o", "compression_type=zstd,cluster_size=65536", raw, p)
	good := filepath.Join(src, "good.qcow2")
	qemu.Img(t, "convert", "-c", "-O", "qcow2", "-o", "compression_type=zstd", raw, good)
	os.Remove(raw)

	// Every compressed cluster of the first L2 table (64 of them) gets
	// a frame declaring a 512 MiB window (the encoder's, patched),
	// appended to the file.
	const x = 62 - (16 - 8)
	enc, err := zstd.NewWriter(nil, zstd.WithWindowSize(512<<20), zstd.WithSingleSegment(false))
	if err != nil {
		t.Fatal(err)
	}
	dec, _ := zstd.NewReader(nil)
	f, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	st, _ := f.Stat()
	end := (st.Size() + 511) &^ 511
	for n := int64(0); n < 64; n++ {
		at, e := qemu.L2EntryOffset(t, p, n)
		if e&(1<<62) == 0 {
			t.Fatalf("cluster %d is not compressed: %#x", n, e)
		}
		off := int64(e & (1<<x - 1))
		sectors := int64((e>>x)&0xff) + 1
		in := make([]byte, sectors*512-off&511)
		f.ReadAt(in, off)
		cluster, err := dec.DecodeAll(in, nil)
		if err != nil && len(cluster) < 65536 {
			t.Fatalf("cluster %d: %v", n, err)
		}
		frame := enc.EncodeAll(cluster[:65536], nil)
		frame[5] = 19 << 3 // the window descriptor: 2^(10+19) bytes
		if _, err := f.WriteAt(frame, end); err != nil {
			t.Fatal(err)
		}
		qemu.PatchU(t, p, at, 8, 1<<62|uint64((len(frame)+511)/512-1)<<x|uint64(end))
		end = (end + int64(len(frame)) + 511) &^ 511
	}
	f.Truncate(end)
	f.Close()

	m := harness.Racy.Mount(t, src)
	pid := m.PID(t)
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Go(func() {
			g, err := os.OpenFile(filepath.Join(m.Dir, "huge.raw"), os.O_RDONLY|unix.O_DIRECT, 0)
			if err != nil {
				errs[i] = err
				return
			}
			defer g.Close()
			buf := harness.AlignedBlock(t, 1<<20)
			for off := int64(i%4) << 20; off < 4<<20; off += 1 << 20 {
				if _, err := g.ReadAt(buf, off); !errors.Is(err, syscall.EIO) {
					errs[i] = fmt.Errorf("read at %d: %v", off, err)
					return
				}
			}
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("reader %d: %v, want EIO", i, err)
		}
	}
	ps := harness.ReadProc(t, pid)
	// The default caches: L2 32M, clusters 64M, and go-fuse's buffers.
	if limit := harness.MemBound(96 + 160); ps.HWMKB > limit {
		t.Errorf("the daemon's peak memory is %d MiB, over %d MiB: %v", ps.HWMKB>>10, limit>>10, ps)
	}
	want, _ := os.ReadFile(qemu.ToRaw(t, good, filepath.Join(t.TempDir(), "good.raw")))
	got, err := os.ReadFile(filepath.Join(m.Dir, "good.raw"))
	if err != nil || !bytes.Equal(got, want) {
		t.Errorf("another image of the mount: %v, equal %v", err, bytes.Equal(got, want))
	}
	m.NoPanics(t)
}
