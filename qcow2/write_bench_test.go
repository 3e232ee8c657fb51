package qcow2

import (
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// Write-path benchmarks on images in memory (/dev/shm where there is one),
// so that they measure the writer's CPU, not the disk: a 4 KiB write in
// place, an allocating 4 KiB write into an empty image, and the metadata
// overlap check each write makes, alone, on the map of an image with many
// L2 tables and refcount blocks. The check's share of the write path is
// BenchmarkOverlapCheck over BenchmarkWriteInPlace4K.

func benchDir(b *testing.B) string {
	if d, err := os.MkdirTemp("/dev/shm", "qcowfs-bench"); err == nil {
		b.Cleanup(func() { os.RemoveAll(d) })
		return d
	}
	return b.TempDir()
}

func benchImage(b *testing.B, size string, cmds ...string) *Image {
	b.Helper()
	p := filepath.Join(benchDir(b), "b.qcow2")
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", p, size).CombinedOutput(); err != nil {
		b.Skipf("qemu-img: %v %s", err, out)
	}
	for _, c := range cmds {
		if out, err := exec.Command("qemu-io", "-f", "qcow2", "-c", c, p).CombinedOutput(); err != nil {
			b.Fatalf("qemu-io: %v %s", err, out)
		}
	}
	f, err := OpenWritableFile(p)
	if err != nil {
		b.Fatal(err)
	}
	img, err := NewImage(f, Options{Writable: true})
	if err != nil || !img.Writable() {
		b.Fatalf("open: %v %s", err, img.ReadOnlyReason())
	}
	b.Cleanup(func() { img.Close() })
	return img
}

func BenchmarkWriteInPlace4K(b *testing.B) {
	img := benchImage(b, "256M", "write -P 1 0 256M")
	buf := make([]byte, 4096)
	r := rand.New(rand.NewPCG(1, 1))
	b.SetBytes(4096)
	b.ResetTimer()
	for range b.N {
		if _, err := img.WriteAt(buf, r.Int64N(256<<20/4096)*4096); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkWriteAllocating4K(b *testing.B) {
	img := benchImage(b, "64G")
	buf := make([]byte, 4096)
	r := rand.New(rand.NewPCG(2, 2))
	b.SetBytes(4096)
	b.ResetTimer()
	for range b.N {
		// A new 64 KiB cluster almost every time.
		if _, err := img.WriteAt(buf, r.Int64N(64<<30/65536)*65536+4096); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkOverlapCheck(b *testing.B) {
	// 8192 L2 tables and their data scattered, so the map has ranges
	// to search: one per L2 table and refcount block.
	img := benchImage(b, "4T")
	for i := int64(0); i < 8192; i++ {
		img.WriteAt([]byte{1}, i*(512<<20))
	}
	img.Flush()
	w := img.w
	m := w.l.metaMap.Load()
	b.Logf("%d metadata ranges", len(m.ranges))
	r := rand.New(rand.NewPCG(3, 3))
	offs := make([]int64, 4096)
	for i := range offs {
		offs[i] = r.Int64N(w.host.size()) &^ 4095
	}
	b.ResetTimer()
	for i := range b.N {
		off := offs[i%len(offs)]
		m := w.l.metaMap.Load()
		m.conflict(off, off+4096, 0)
	}
}
