package write

import (
	"bytes"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// Persistent dirty bitmaps through writable mounts (issue 36), with qemu
// as the oracle: what qemu-nbd -B says each bitmap holds after the mount
// is what the writes touched, rounded out to the bitmap's granularity (a
// model).

// granules is a model of a bitmap: the dirty granules of granularity gran.
type granules struct {
	gran int64
	set  map[int64]bool
}

func newGranules(gran int64, dirty [][2]int64) *granules {
	g := &granules{gran: gran, set: map[int64]bool{}}
	for _, r := range dirty {
		g.add(r[0], r[1]-r[0])
	}
	return g
}

// add marks the granules of [off, off+n).
func (g *granules) add(off, n int64) {
	for i := off / g.gran; n > 0 && i <= (off+n-1)/g.gran; i++ {
		g.set[i] = true
	}
}

// ranges are the dirty granules as merged [start, end) ranges of a disk
// of size bytes.
func (g *granules) ranges(size int64) [][2]int64 {
	keys := make([]int64, 0, len(g.set))
	for k := range g.set {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var out [][2]int64
	for _, k := range keys {
		s, e := k*g.gran, min((k+1)*g.gran, size)
		if s >= size {
			continue
		}
		if n := len(out); n > 0 && out[n-1][1] == s {
			out[n-1][1] = e
			continue
		}
		out = append(out, [2]int64{s, e})
	}
	return out
}

// TestBitmapImageReopened: an image with bitmaps, written and closed and
// opened again at once, again and again (its views stat'ed between), stays
// writable: the open waits for the last close, which clears in_use (and
// gives back space), instead of finding the bitmap in use and opening the
// image read-only.
func TestBitmapImageReopened(t *testing.T) {
	harness.RequireFUSE(t)
	src := qemu.TempDir(t)
	img := filepath.Join(src, "vm.qcow2")
	qemu.Create(t, "qcow2", img, "16M")
	qemu.Img(t, "bitmap", "--add", img, "daily")
	m := harness.Racy.Mount(t, src, "--writable")
	disk := filepath.Join(m.Dir, "vm.raw")
	model := newGranules(64<<10, nil)
	for i := range 200 {
		f, err := os.OpenFile(disk, os.O_RDWR, 0)
		if err != nil {
			t.Fatalf("open %d for writing: %v\n%s", i, err, m.LogText(t))
		}
		off := int64(i%200) * 80 << 10
		if _, err := f.WriteAt(bytes.Repeat([]byte{byte(i)}, 4096), off); err != nil {
			t.Fatal(err)
		}
		model.add(off, 4096)
		if err := f.Close(); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(filepath.Join(m.Dir, "vm.raw.bitmaps", "daily.raw")); err != nil {
			t.Fatalf("stat of the view after close %d: %v\n%s", i, err, m.LogText(t))
		}
	}
	m.Unmount(t)
	harness.WaitGone(t, m.Dir)
	if log := m.LogText(t); strings.Contains(log, "read-only") || strings.Contains(log, "not shown") {
		t.Errorf("the image was opened read-only (or a view not shown) along the way:\n%s", log)
	}
	if got, want := qemu.DirtyRanges(t, img, "daily"), model.ranges(16<<20); !slices.Equal(got, want) {
		t.Errorf("qemu says dirty %v, want %v", got, want)
	}
	qemu.CheckClean(t, img)
}
