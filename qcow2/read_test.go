package qcow2_test

import (
	"bytes"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestReadMatchesQemu reads every image of the matrix with the library and
// compares with what qemu-img convert -O raw makes of it.
func TestReadMatchesQemu(t *testing.T) {
	t.Parallel() // (beside the package's other long tests; it has its own folder)
	dir := qemu.TempDir(t)
	for _, im := range qemu.Matrix(t, dir) {
		t.Run(im.Name, func(t *testing.T) {
			want, err := os.ReadFile(qemu.ToRaw(t, im.Path, filepath.Join(dir, im.Name+".expect")))
			if err != nil {
				t.Fatal(err)
			}
			img, err := qcow2.Open(im.Path, qcow2.Options{Cache: qcow2.NewCache(256<<10, 1<<20)})
			if err != nil {
				t.Fatal(err)
			}
			defer img.Close()
			if img.Size() != int64(len(want)) {
				t.Fatalf("Size() = %d, qemu-img convert made %d bytes", img.Size(), len(want))
			}

			// Whole disk, 1 MiB at a time.
			got := make([]byte, len(want))
			for off := 0; off < len(got); off += 1 << 20 {
				end := min(off+1<<20, len(got))
				if n, err := img.ReadAt(got[off:end], int64(off)); n != end-off || (err != nil && err != io.EOF) {
					t.Fatalf("ReadAt(%d, %d) = %d, %v", off, end-off, n, err)
				}
			}
			if i := firstDiff(got, want); i >= 0 {
				t.Fatalf("whole-disk read differs from qemu at byte %d: got %#x, want %#x", i, got[i], want[i])
			}

			// Reads of every size and alignment, from 1 byte up,
			// in parallel.
			var wg sync.WaitGroup
			for w := 0; w < 4; w++ {
				wg.Add(1)
				go func(seed uint64) {
					defer wg.Done()
					r := rand.New(rand.NewPCG(seed, 1))
					buf := make([]byte, 300000)
					for i := 0; i < 300; i++ {
						off := r.IntN(len(want))
						n := 1 + r.IntN(min(len(buf), len(want)-off))
						if i%3 == 0 {
							n = 1 + r.IntN(70)
						}
						got, err := img.ReadAt(buf[:n], int64(off))
						if got != n || (err != nil && err != io.EOF) {
							t.Errorf("ReadAt(%d, %d) = %d, %v", off, n, got, err)
							return
						}
						if !bytes.Equal(buf[:n], want[off:off+n]) {
							t.Errorf("ReadAt(%d, %d) differs from qemu at byte %d", off, n, off+firstDiff(buf[:n], want[off:off+n]))
							return
						}
					}
				}(uint64(w))
			}
			wg.Wait()

			// A read running past the end stops there with io.EOF.
			buf := make([]byte, 4096)
			n, err := img.ReadAt(buf, int64(len(want))-100)
			if n != 100 || err != io.EOF || !bytes.Equal(buf[:100], want[len(want)-100:]) {
				t.Fatalf("ReadAt across the end = %d, %v", n, err)
			}
		})
	}
}

func firstDiff(a, b []byte) int {
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

// compareWithRaw reads the whole image, 1 MiB at a time, and compares it
// with the raw file qemu made of it.
func compareWithRaw(t *testing.T, img *qcow2.Image, raw string) {
	t.Helper()
	want, err := os.ReadFile(raw)
	if err != nil {
		t.Fatal(err)
	}
	if img.Size() != int64(len(want)) {
		t.Fatalf("Size() = %d, qemu made %d bytes", img.Size(), len(want))
	}
	got := make([]byte, len(want))
	for off := 0; off < len(got); off += 1 << 20 {
		end := min(off+1<<20, len(got))
		if n, err := img.ReadAt(got[off:end], int64(off)); n != end-off || (err != nil && err != io.EOF) {
			t.Fatalf("ReadAt(%d, %d) = %d, %v", off, end-off, n, err)
		}
	}
	if i := firstDiff(got, want); i >= 0 {
		t.Fatalf("differs from qemu at byte %d: got %#x, want %#x", i, got[i], want[i])
	}
}
