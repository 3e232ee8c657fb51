package read

import (
	"bytes"
	"io"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestRereadWithHoles: a disk read once is in the kernel's page cache;
// with holes punched into that cache (what proactive reclaim and memory
// pressure leave: here every fourth page, with POSIX_FADV_DONTNEED), a
// sequential re-read gets the kernel's requests for the holes alone, a
// page at a time, unless the daemon drops the rest of the cache once it
// sees them (fs/reread.go): the re-read must reach the daemon in few,
// large requests, and read the disk's bytes.
func TestRereadWithHoles(t *testing.T) {
	harness.RequireFUSE(t)
	src := t.TempDir()
	img := filepath.Join(src, "d.qcow2")
	const size = 64 << 20
	qemu.Create(t, "qcow2", img, "64M")
	qemu.IO(t, img, "write -P 0x5c 0 64M")
	want := qemu.RawBytes(t, img)
	m := harness.Mount(t, src)
	raw := filepath.Join(m.Dir, "d.raw")
	// A handle held open, so that the image stays open and its counters
	// in the status with it.
	hold := harness.Open(t, raw)
	defer hold.Close()
	if _, err := io.Copy(io.Discard, hold); err != nil {
		t.Fatal(err)
	}
	for p := int64(4096); p < size; p += 4 * 4096 {
		if err := unix.Fadvise(int(hold.Fd()), p, 4096, unix.FADV_DONTNEED); err != nil {
			t.Fatal(err)
		}
	}
	requests := func() int64 {
		st, _ := harness.StatusOf(t, m.Dir)
		for _, oi := range st.Images.Open {
			return oi.ReadRequests
		}
		t.Fatal("the image is not open")
		return 0
	}
	before := requests()
	f := harness.Open(t, raw)
	defer f.Close()
	got, err := io.ReadAll(f)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("the re-read differs from qemu-img convert's bytes")
	}
	n := requests() - before
	// The holes are 4096 pages: one request each without the drop.
	if n > 256 {
		t.Errorf("the re-read of a 64 MiB disk whose cached pages have a hole every 16 KiB took %d requests", n)
	}
	t.Logf("re-read: %d requests", n)
}
