package read

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
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
	harness.RequireFUSE(t)
	src := qemu.TempDir(t)
	images := qemu.StatusMatrix(t, src)
	m := harness.Mount(t, src)
	out := t.TempDir()

	for _, im := range images {
		t.Run(im.Name, func(t *testing.T) {
			p := filepath.Join(m.Dir, im.Name+".raw")
			f, err := os.Open(p)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			st, _ := f.Stat()
			runs := harness.SeekRuns(t, f, st.Size())
			qemu.CheckHoles(t, im.Path, runs) // before anything reads the data

			var data int64
			for _, r := range runs {
				data += r[1] - r[0]
			}
			// st_blocks becomes the exact data size once the daemon
			// has counted it in the background.
			harness.WaitFor(t, "st_blocks to reflect the data", 10*time.Second, func() bool {
				var st syscall.Stat_t
				syscall.Stat(p, &st)
				return st.Blocks == (data+511)/512
			})

			// cp --sparse=always: same bytes as qemu, and no more
			// allocated than the data plus a cluster per extent.
			copyPath := filepath.Join(out, im.Name+".raw")
			if b, err := exec.Command("cp", "--sparse=always", p, copyPath).CombinedOutput(); err != nil {
				t.Fatalf("cp: %v %s", err, b)
			}
			harness.SameFile(t, copyPath, qemu.ToRaw(t, im.Path, filepath.Join(out, im.Name+".qemu")))
			var cst syscall.Stat_t
			syscall.Stat(copyPath, &cst)
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
	harness.RequireFUSE(t)
	src := qemu.TempDir(t)
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

	f, err := os.Open(filepath.Join(m.Dir, "odd.raw"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
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

	e, err := os.Open(filepath.Join(m.Dir, "empty.raw"))
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
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
