package read

import (
	"bytes"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestMountMatchesQemu mounts the whole image matrix and checks that every
// exposed raw file has exactly the bytes of qemu-img convert -O raw, read
// sequentially and with many concurrent readers at odd offsets and sizes.
func TestMountMatchesQemu(t *testing.T) {
	harness.RequireFUSE(t)
	src := qemu.TempDir(t)
	images := qemu.Matrix(t, src)
	expect := t.TempDir()
	for _, im := range images {
		qemu.ToRaw(t, im.Path, filepath.Join(expect, im.Name+".raw"))
	}
	// Both ways of answering reads: zero-copy (splice) and copying.
	for _, readPath := range []string{"splice", "copy"} {
		t.Run(readPath, func(t *testing.T) { checkMountMatchesQemu(t, src, expect, images, readPath) })
	}
}

func checkMountMatchesQemu(t *testing.T, src, expect string, images []qemu.Image, readPath string) {
	m := harness.Racy.Mount(t, src, "--read-path="+readPath)
	for _, im := range images {
		t.Run(im.Name, func(t *testing.T) {
			want := filepath.Join(expect, im.Name+".raw")
			got := filepath.Join(m.Dir, im.Name+".raw")

			// Concurrent random reads first, while the page cache is
			// cold, so they reach the daemon in parallel.
			wantBytes, err := os.ReadFile(want)
			if err != nil {
				t.Fatal(err)
			}
			var wg sync.WaitGroup
			for w := 0; w < 8; w++ {
				wg.Add(1)
				go func(seed uint64) {
					defer wg.Done()
					f, err := os.Open(got)
					if err != nil {
						t.Error(err)
						return
					}
					defer f.Close()
					r := rand.New(rand.NewPCG(seed, 2))
					buf := make([]byte, 200000)
					for i := 0; i < 100; i++ {
						off := r.IntN(len(wantBytes))
						n := 1 + r.IntN(min(len(buf), len(wantBytes)-off))
						if i%2 == 0 {
							n = 1 + r.IntN(min(5000, len(wantBytes)-off))
						}
						if k, err := f.ReadAt(buf[:n], int64(off)); k != n || (err != nil && err != io.EOF) {
							t.Errorf("pread(%d, %d) = %d, %v", off, n, k, err)
							return
						}
						if !bytes.Equal(buf[:n], wantBytes[off:off+n]) {
							t.Errorf("pread(%d, %d) differs from qemu-img convert", off, n)
							return
						}
					}
				}(uint64(w))
			}
			wg.Wait()
			harness.SameFile(t, got, want)
		})
	}
}
