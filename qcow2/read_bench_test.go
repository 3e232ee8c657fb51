package qcow2_test

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/test/qemu"
)

var (
	benchOnce   sync.Once
	benchImages = map[int]string{}
)

// benchImagePath returns a 512 MiB image, fully allocated by qemu-io, with
// the given cluster size (64 KiB or 4 KiB); the images are made once per
// test binary.
func benchImagePath(b *testing.B, clusterSize int) string {
	benchOnce.Do(func() {
		dir, err := os.MkdirTemp("", "qcow2-bench")
		if err != nil {
			b.Fatal(err)
		}
		for _, cs := range []int{4096, 65536} {
			p := filepath.Join(dir, fmt.Sprintf("bench-%d.qcow2", cs))
			qemu.Create(b, "qcow2", p, "512M", "-o", fmt.Sprintf("cluster_size=%d", cs))
			qemu.IO(b, p, "write -P 0x5a 0 512M")
			benchImages[cs] = p
		}
	})
	return benchImages[clusterSize]
}

// BenchmarkReadAt measures the library's read path (no FUSE): 4 KiB and
// 1 MiB reads, sequential and random, with the L2 tables cached ("warm",
// 64 KiB clusters) and with a cache that holds almost nothing over an image
// of 256 small L2 tables ("cold", 4 KiB clusters: nearly every random read
// loads a table). The host file is in the page cache after the first
// pass, so this is CPU cost, not disk speed.
func BenchmarkReadAt(b *testing.B) {
	for _, bc := range []struct {
		name    string
		size    int
		random  bool
		cluster int
		cache   int64
	}{
		{"4K/seq/warm", 4 << 10, false, 65536, 32 << 20},
		{"4K/rand/warm", 4 << 10, true, 65536, 32 << 20},
		{"4K/rand/cold", 4 << 10, true, 4096, 1},
		{"1M/seq/warm", 1 << 20, false, 65536, 32 << 20},
		{"1M/rand/warm", 1 << 20, true, 65536, 32 << 20},
		{"1M/rand/cold", 1 << 20, true, 4096, 1},
	} {
		b.Run(bc.name, func(b *testing.B) {
			img, err := qcow2.Open(benchImagePath(b, bc.cluster), qcow2.Options{Cache: qcow2.NewCache(bc.cache, 0)})
			if err != nil {
				b.Fatal(err)
			}
			defer img.Close()
			buf := make([]byte, bc.size)
			blocks := img.Size() / int64(bc.size)
			r := rand.New(rand.NewPCG(1, 2))
			b.SetBytes(int64(bc.size))
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				blk := int64(i) % blocks
				if bc.random {
					blk = r.Int64N(blocks)
				}
				if _, err := img.ReadAt(buf, blk*int64(bc.size)); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkExtent measures block status: one Extent call per cluster-sized
// step over a cached image.
func BenchmarkExtent(b *testing.B) {
	img, err := qcow2.Open(benchImagePath(b, 65536), qcow2.Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer img.Close()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		off := int64(i%8192) << 16
		if _, err := img.Extent(off, 1<<20); err != nil {
			b.Fatal(err)
		}
	}
}
