package read

// Holes through a mount: lseek walks against qemu-img map, st_blocks, cp
// --sparse; and the changed-blocks views of bitmaps, whose data runs are
// the ranges qemu reports dirty.

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

func clusterSize(t *testing.T, image string) int64 {
	return int64(qemu.Info(t, image)["cluster-size"].(float64))
}

// TestSeekThroughMount walks every image of the status matrix through the
// mount with lseek and checks the walk against qemu-img map; then copies
// each out with cp --sparse=always and checks bytes and allocation; and
// checks st_blocks against the data the walk found.
func TestSeekThroughMount(t *testing.T) {
	src := harness.SourceDir(t)
	images := qemu.StatusMatrix(t, src)
	m := harness.Mount(t, src)
	out := t.TempDir()

	for _, im := range images {
		t.Run(im.Name, func(t *testing.T) {
			p := filepath.Join(m.Dir, im.Name+".raw")
			runs := harness.FileRuns(t, p)
			qemu.CheckHoles(t, im.Path, runs) // before anything reads the data

			var data int64
			for _, r := range runs {
				data += r[1] - r[0]
			}
			// st_blocks becomes the exact data size once the daemon
			// has counted it in the background.
			harness.WaitFor(t, "st_blocks to reflect the data", 10*time.Second, func() bool {
				var st unix.Stat_t
				unix.Stat(p, &st)
				return st.Blocks == (data+511)/512
			})

			// cp --sparse=always: same bytes as qemu, and no more
			// allocated than the data plus a cluster per extent.
			copyPath := filepath.Join(out, im.Name+".raw")
			harness.WantOK(t, "cp", harness.Exec(t, "cp", "--sparse=always", p, copyPath))
			harness.SameFile(t, copyPath, qemu.ToRaw(t, im.Path, filepath.Join(out, im.Name+".qemu")))
			var cst unix.Stat_t
			unix.Stat(copyPath, &cst)
			limit := data + int64(len(runs))*max(clusterSize(t, im.Path), 4096)
			if got := cst.Blocks * 512; got > limit {
				t.Errorf("the sparse copy allocates %d bytes; the data is %d bytes in %d extents", got, data, len(runs))
			}
			if strings.HasPrefix(im.Name, "prealloc") || im.Name == "empty" {
				if data > 0 && im.Name == "empty" || cst.Blocks*512 > data {
					t.Errorf("copy of %s allocates %d bytes for %d bytes of data", im.Name, cst.Blocks*512, data)
				}
			}
			os.Remove(copyPath)
		})
	}
}

// TestSeekEdgesThroughMount: lseek at the start, in the last partial
// cluster, at and past the end, on a disk with no data; other whence
// values behave as on any file.
func TestSeekEdgesThroughMount(t *testing.T) {
	src := harness.SourceDir(t)
	odd := filepath.Join(src, "odd.qcow2")
	qemu.Create(t, "qcow2", odd, "10000000") // not a multiple of 64 KiB
	qemu.IO(t, odd, "write -P 7 9960000 40000")
	qemu.Create(t, "qcow2", filepath.Join(src, "empty.qcow2"), "1M")
	var firstData int64 = -1 // where qemu says the data starts
	for _, e := range qemu.Map(t, odd) {
		if e.Data && firstData < 0 {
			firstData = e.Start
		}
	}
	m := harness.Mount(t, src)

	f := harness.Open(t, filepath.Join(m.Dir, "odd.raw"))
	fd := int(f.Fd())
	st, _ := f.Stat() // qemu-img rounds the size up to a multiple of 512
	size := st.Size()
	for _, tc := range []struct {
		name   string
		off    int64
		whence int
		want   int64
		err    error
	}{
		{"SEEK_DATA at 0", 0, unix.SEEK_DATA, firstData, nil},
		{"SEEK_HOLE at 0", 0, unix.SEEK_HOLE, 0, nil},
		{"SEEK_DATA in the last partial cluster", size - 1, unix.SEEK_DATA, size - 1, nil},
		{"SEEK_HOLE in the last partial cluster", size - 1, unix.SEEK_HOLE, size, nil},
		{"SEEK_DATA at EOF", size, unix.SEEK_DATA, 0, unix.ENXIO},
		{"SEEK_HOLE at EOF", size, unix.SEEK_HOLE, 0, unix.ENXIO},
		{"SEEK_DATA past EOF", size + 1<<20, unix.SEEK_DATA, 0, unix.ENXIO},
		{"SEEK_SET", 12345, unix.SEEK_SET, 12345, nil},
		{"SEEK_END", -10, unix.SEEK_END, size - 10, nil},
	} {
		got, err := unix.Seek(fd, tc.off, tc.whence)
		if !errors.Is(err, tc.err) || (err == nil && got != tc.want) {
			t.Errorf("%s: lseek = %d, %v; want %d, %v", tc.name, got, err, tc.want, tc.err)
		}
	}

	e := harness.Open(t, filepath.Join(m.Dir, "empty.raw"))
	if _, err := unix.Seek(int(e.Fd()), 0, unix.SEEK_DATA); !errors.Is(err, unix.ENXIO) {
		t.Errorf("SEEK_DATA on a disk without data: %v, want ENXIO", err)
	}
	if h, err := unix.Seek(int(e.Fd()), 0, unix.SEEK_HOLE); h != 0 || err != nil {
		t.Errorf("SEEK_HOLE on a disk without data = %d, %v", h, err)
	}
	// du reports the data once the daemon has counted it.
	harness.WaitFor(t, "du of a disk without data to be 0", 10*time.Second, func() bool {
		out, _ := exec.Command("du", "--block-size=1", filepath.Join(m.Dir, "empty.raw")).Output()
		return strings.HasPrefix(string(out), "0\t")
	})
}

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
	disk := qemu.RawBytes(t, img)
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
			f := harness.Open(t, view)
			var st unix.Stat_t
			if err := unix.Fstat(int(f.Fd()), &st); err != nil {
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
			harness.Open(t, filepath.Join(m.Dir, "vm.raw"))
			st0, _ := harness.StatusOf(t, m.Dir)
			out := filepath.Join(t.TempDir(), "incr.raw")
			harness.WantOK(t, "cp", harness.Exec(t, "cp", "--sparse=always", view, out))
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
