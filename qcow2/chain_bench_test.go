package qcow2_test

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"

	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/test/qemu"
)

var (
	chainMu     sync.Mutex
	chainImages = map[int]string{}
)

// chainImage returns the top of a backing chain of depth layers over a
// 256 MiB disk of 64 KiB clusters in which layer k (0 the base) holds the
// clusters c with c%depth == k: every layer holds 1/depth of the disk,
// spread over all of it, so a read walks on average half the chain. Made
// once per test binary and depth.
func chainImage(b *testing.B, depth int) string {
	chainMu.Lock()
	defer chainMu.Unlock()
	if p := chainImages[depth]; p != "" {
		return p
	}
	dir, err := os.MkdirTemp("", "qcow2-chain")
	if err != nil {
		b.Fatal(err)
	}
	const size, cs = 256 << 20, 65536
	prev := ""
	for k := range depth {
		p := filepath.Join(dir, fmt.Sprintf("l%02d.qcow2", k))
		if prev == "" {
			qemu.Create(b, "qcow2", p, "256M")
		} else {
			qemu.Create(b, "qcow2", p, "256M", "-b", filepath.Base(prev), "-F", "qcow2")
		}
		var cmds []string
		for c := k; c < size/cs; c += depth {
			cmds = append(cmds, fmt.Sprintf("write -P %d %d %d", 1+k%250, c*cs, cs))
		}
		qemu.IO(b, p, cmds...)
		prev = p
	}
	chainImages[depth] = prev
	return prev
}

// cpuTime is the process's CPU time so far, in nanoseconds.
func cpuTime() int64 {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return ru.Utime.Nano() + ru.Stime.Nano()
}

// BenchmarkChainRead measures 4 KiB random reads through backing chains of
// depth 1 to 64 (chainImage), with the tables cached ("warm"), and from a
// freshly opened image every 4096 reads, about one per cluster of the disk
// ("fresh": what a short random reader pays, the chain index built as it
// goes). CPU ns per read is reported beside the wall time, which a shared
// machine's other load moves more.
func BenchmarkChainRead(b *testing.B) {
	for _, depth := range []int{1, 4, 16, 64} {
		for _, fresh := range []bool{false, true} {
			name := fmt.Sprintf("depth%d/warm", depth)
			if fresh {
				name = fmt.Sprintf("depth%d/fresh", depth)
			}
			b.Run(name, func(b *testing.B) {
				path := chainImage(b, depth)
				open := func() *qcow2.Image {
					img, err := qcow2.Open(path, qcow2.Options{Cache: qcow2.NewCache(64<<20, 0)})
					if err != nil {
						b.Fatal(err)
					}
					return img
				}
				img := open()
				defer func() { img.Close() }()
				buf := make([]byte, 4096)
				blocks := img.Size() / 4096
				r := rand.New(rand.NewPCG(1, 2))
				b.SetBytes(4096)
				b.ResetTimer()
				cpu := cpuTime()
				for i := 0; i < b.N; i++ {
					if fresh && i > 0 && i%4096 == 0 {
						b.StopTimer()
						c := cpuTime()
						img.Close()
						img = open()
						cpu -= cpuTime() - c
						b.StartTimer()
					}
					if _, err := img.ReadAt(buf, r.Int64N(blocks)*4096); err != nil {
						b.Fatal(err)
					}
				}
				// CPU time, which a shared machine's other load
				// changes less than the wall clock.
				b.ReportMetric(float64(cpuTime()-cpu)/float64(b.N), "cpu-ns/op")
			})
		}
	}
}
