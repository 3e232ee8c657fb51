package read

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestBitmapViews: the changed-blocks views of a read-only mount, with
// qemu as the oracle. For each bitmap qemu made (64 KiB granularity, 512
// B, and a disabled one of 1 MiB whose name needs escaping), the view
// vm.raw.bitmaps/NAME.raw is as large as the disk, its SEEK_DATA/SEEK_HOLE
// runs are what qemu-nbd -B reports dirty, st_blocks is their bytes, and
// it reads as the disk there and zeros elsewhere; cp --sparse=always of a
// view reads exactly the dirty bytes through the mount (qcowfs status).
// A bitmap in use gets no view, with a log line; an image without bitmaps
// no folder; --no-bitmap-views hides the folders.
func TestBitmapViews(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "qemu-nbd")
	src := qemu.TempDir(t)
	img := filepath.Join(src, "vm.qcow2")
	qemu.Create(t, "qcow2", img, "48M")
	qemu.Img(t, "bitmap", "--add", img, "stale") // the first directory entry
	qemu.Img(t, "bitmap", "--add", img, "daily")
	qemu.Img(t, "bitmap", "--add", "-g", "512", img, "fine")
	qemu.Img(t, "bitmap", "--add", "-g", "1M", img, "we/ird%")
	qemu.IO(t, img, "write -P 1 100k 10k", "write -P 2 3M 1M", "write -z 20M 64k", "discard 30M 1M", "write -P 3 50330648 1000")
	qemu.Img(t, "bitmap", "--disable", img, "we/ird%")
	qemu.IO(t, img, "write -P 4 10M 4k")
	_, _, dirOff, _ := qemu.BitmapDirectory(t, img)
	qemu.PatchU(t, img, dirOff+12, 4, 3) // stale: in_use, auto
	qemu.Create(t, "qcow2", filepath.Join(src, "plain.qcow2"), "1M")
	disk, err := os.ReadFile(qemu.ToRaw(t, img, filepath.Join(t.TempDir(), "vm.raw")))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][][2]int64{}
	for _, name := range []string{"daily", "fine", "we/ird%"} {
		want[name] = qemu.DirtyRanges(t, img, name)
	}

	m := harness.Mount(t, src)
	if names := harness.Names(t, m.Dir); !slices.Equal(names, []string{"plain.raw", "vm.raw", "vm.raw.bitmaps"}) {
		t.Errorf("the mount shows %v", names)
	}
	views := filepath.Join(m.Dir, "vm.raw.bitmaps")
	if names := harness.Names(t, views); !slices.Equal(names, []string{"daily.raw", "fine.raw", "we%2Fird%25.raw"}) {
		t.Errorf("vm.raw.bitmaps holds %v", names)
	}
	if log := m.LogText(t); !strings.Contains(log, "bitmap view not shown") || !strings.Contains(log, "stale") {
		t.Errorf("the log does not say the bitmap in use gets no view:\n%s", log)
	}
	for name, dirty := range want {
		t.Run(strings.ReplaceAll(name, "/", "_"), func(t *testing.T) {
			view := filepath.Join(views, strings.ReplaceAll(strings.ReplaceAll(name, "%", "%25"), "/", "%2F")+".raw")
			f, err := os.Open(view)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			var st syscall.Stat_t
			if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
				t.Fatal(err)
			}
			var n int64
			for _, r := range dirty {
				n += r[1] - r[0]
			}
			if st.Size != int64(len(disk)) || st.Blocks*512 != n || st.Mode&0o222 != 0 {
				t.Errorf("size %d, %d blocks, mode %o; want %d, the dirty bytes %d / 512, read-only", st.Size, st.Blocks, st.Mode, len(disk), n)
			}
			if got := harness.SeekRuns(t, f, st.Size); !slices.Equal(got, dirty) {
				t.Errorf("SEEK_DATA/SEEK_HOLE: %v; qemu says dirty %v", got, dirty)
			}
			expect := make([]byte, len(disk))
			for _, r := range dirty {
				copy(expect[r[0]:r[1]], disk[r[0]:r[1]])
			}
			b, err := os.ReadFile(view)
			if err != nil {
				t.Fatal(err)
			}
			if i := harness.FirstDiff(b, expect); i >= 0 {
				t.Errorf("the view differs from the disk's dirty bytes at %d", i)
			}

			// A backup copies the view: it reads the dirty bytes and
			// nothing else (the disk's file, held open, keeps the
			// image's counters).
			hold, err := os.Open(filepath.Join(m.Dir, "vm.raw"))
			if err != nil {
				t.Fatal(err)
			}
			defer hold.Close()
			st0, _ := harness.StatusOf(t, m.Dir)
			out := filepath.Join(t.TempDir(), "incr.raw")
			harness.WantOK(t, "cp", harness.RunCmd(t, exec.Command("cp", "--sparse=always", view, out)))
			st1, _ := harness.StatusOf(t, m.Dir)
			e0, e1 := st0.OpenEntry(img), st1.OpenEntry(img)
			if e0 == nil || e1 == nil {
				t.Fatalf("the image is not open: %+v", st1)
			}
			if read := e1.ReadBytes - e0.ReadBytes; read != n {
				t.Errorf("cp --sparse=always read %d bytes through the mount, want the %d dirty bytes", read, n)
			}
			if got, err := os.ReadFile(out); err != nil || !bytes.Equal(got, expect) {
				t.Errorf("cp --sparse=always of the view: %v, differs at %d", err, harness.FirstDiff(got, expect))
			}
		})
	}

	off := harness.Mount(t, src, "--no-bitmap-views")
	if names := harness.Names(t, off.Dir); !slices.Equal(names, []string{"plain.raw", "vm.raw"}) {
		t.Errorf("with --no-bitmap-views the mount shows %v", names)
	}
}
