package write

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestSectorsNeverTorn: a disk never tears a 512-byte sector, so neither
// may qcowfs. Two O_DIRECT writers rewrite the same 64 KiB of an image with
// 512 B clusters (every cluster allocated, so every write is in place),
// each write filling every sector with one byte value, while two O_DIRECT
// readers read the range over and over: every sector a reader gets is one
// value, whole. With the writeback cache off, so that every write and read
// crosses FUSE.
func TestSectorsNeverTorn(t *testing.T) {
	harness.RequireFUSE(t)
	src := t.TempDir()
	img := filepath.Join(src, "torn.qcow2")
	qemu.Create(t, "qcow2", img, "1M", "-o", "cluster_size=512")
	qemu.IO(t, img, "write -P 0x1 0 1M")
	m := harness.Racy.Mount(t, src, "--writable", "--no-writeback-cache")
	raw := filepath.Join(m.Dir, "torn.raw")
	const span = 64 << 10
	deadline := time.Now().Add(3 * time.Second)
	var torn atomic.Int64
	var first atomic.Value
	var reads, writes atomic.Int64
	var wg sync.WaitGroup
	run := func(write bool, id int) {
		defer wg.Done()
		f, err := os.OpenFile(raw, os.O_RDWR|unix.O_DIRECT, 0)
		if err != nil {
			first.CompareAndSwap(nil, err.Error())
			torn.Add(1)
			return
		}
		defer f.Close()
		buf := harness.AlignedBlock(t, span)
		for n := 0; time.Now().Before(deadline); n++ {
			if write {
				v := byte(2 + (n*2+id)%250)
				for i := range buf {
					buf[i] = v
				}
				if _, err := f.WriteAt(buf, 0); err != nil {
					first.CompareAndSwap(nil, err.Error())
					torn.Add(1)
					return
				}
				writes.Add(1)
				continue
			}
			if _, err := f.ReadAt(buf, 0); err != nil {
				first.CompareAndSwap(nil, err.Error())
				torn.Add(1)
				return
			}
			reads.Add(1)
			for s := 0; s < span; s += 512 {
				for i := s + 1; i < s+512; i++ {
					if buf[i] != buf[s] {
						first.CompareAndSwap(nil, fmt.Sprintf("sector %d torn: byte %d is %#x, byte %d is %#x", s/512, s, buf[s], i, buf[i]))
						torn.Add(1)
						break
					}
				}
			}
		}
	}
	for id := range 2 {
		wg.Add(2)
		go run(true, id)
		go run(false, id)
	}
	wg.Wait()
	if torn.Load() > 0 {
		t.Fatalf("%d torn sectors or errors in %d reads and %d writes; the first: %v", torn.Load(), reads.Load(), writes.Load(), first.Load())
	}
	t.Logf("%d reads, %d writes, no sector torn", reads.Load(), writes.Load())
}
