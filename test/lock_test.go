package test

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/qemu"
)

// holdOpen starts qemu-io on image (read-write) and keeps it running, so
// it holds qemu's locks, until the test ends or release is called.
func holdOpen(t *testing.T, image string) (release func()) {
	t.Helper()
	cmd := exec.Command("qemu-io", "-f", "qcow2", image)
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// qemu-io prints its prompt once the image is open: wait for it, so
	// the locks are taken before the test goes on.
	buf := make([]byte, 64)
	var got []byte
	for !strings.Contains(string(got), "qemu-io>") {
		n, err := out.Read(buf)
		if err != nil {
			t.Fatalf("qemu-io on %s: %v (%s)", image, err, got)
		}
		got = append(got, buf[:n]...)
	}
	done := false
	release = func() {
		if done {
			return
		}
		done = true
		io.WriteString(in, "quit\n")
		in.Close()
		cmd.Wait()
	}
	t.Cleanup(release)
	return release
}

// TestLockQemuWriting: an image a running qemu has open for writing is not
// served (one log line names the image and the lock), unless --force-share;
// once qemu lets go, it is shown.
func TestLockQemuWriting(t *testing.T) {
	requireFUSE(t)
	src := qemu.TempDir(t)
	busy := filepath.Join(src, "busy.qcow2")
	qemu.Create(t, "qcow2", busy, "4M")
	qemu.Create(t, "qcow2", filepath.Join(src, "free.qcow2"), "4M")
	release := holdOpen(t, busy)

	m := mountImages(t, src)
	if got := names(t, m.Dir); !slices.Equal(got, []string{"free.raw"}) {
		t.Fatalf("lists %q; the image qemu writes must not be shown", got)
	}
	names(t, m.Dir) // tried again, not logged again
	if log := m.logText(t); countLines(log, "busy.qcow2") != 1 || !strings.Contains(log, `lock (byte 101)`) {
		t.Errorf("want one log line naming busy.qcow2 and the write lock:\n%s", log)
	}

	shared := mountImages(t, src, "--force-share")
	if got := names(t, shared.Dir); !slices.Equal(got, []string{"busy.raw", "free.raw"}) {
		t.Errorf("with --force-share, lists %q", got)
	}

	release()
	if got := names(t, m.Dir); !slices.Equal(got, []string{"busy.raw", "free.raw"}) {
		t.Errorf("after qemu closed the image, lists %q", got)
	}
}

// TestLockOnlyWhileOpen: listing and stat take no lock, so qemu writes,
// snapshots and converts images that are shown; while a raw file of an
// image is open, qcowfs holds a reader's locks and qemu cannot open the
// image for writing (qemu's own error), though it can still read it; after
// the last close, qemu can write it again.
func TestLockOnlyWhileOpen(t *testing.T) {
	requireFUSE(t)
	src := qemu.TempDir(t)
	img := filepath.Join(src, "vm.qcow2")
	qemu.Create(t, "qcow2", img, "4M")
	m := mountImages(t, src)
	if got := names(t, m.Dir); !slices.Equal(got, []string{"vm.raw"}) {
		t.Fatalf("lists %q", got)
	}
	if _, err := os.Stat(filepath.Join(m.Dir, "vm.raw")); err != nil {
		t.Fatal(err)
	}
	// Listed and stat'ed only: no lock in qemu's way.
	qemu.IO(t, img, "write -P 0x11 0 64k")
	qemu.Img(t, "snapshot", "-c", "listed", img)

	// Open: qemu cannot write, but can read.
	f, err := os.Open(filepath.Join(m.Dir, "vm.raw"))
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("qemu-io", "-f", "qcow2", "-c", "write 0 4k", img).CombinedOutput()
	if err == nil || !strings.Contains(string(out), `Failed to get "write" lock`) {
		t.Errorf("qemu-io writing an image open in the mount: %v, %s; want qemu's write lock error", err, out)
	}
	if out, err := exec.Command("qemu-img", "info", img).CombinedOutput(); err != nil {
		t.Errorf("qemu-img info (a reader) on an open image: %v, %s", err, out)
	}
	f.Close()

	// Closed again (release is asynchronous in the kernel: FUSE sends
	// RELEASE after close returns), then qemu writes it.
	waitFor(t, "the image's locks to be dropped after close", 5*time.Second, func() bool {
		return exec.Command("qemu-io", "-f", "qcow2", "-c", "write 0 4k", img).Run() == nil
	})
}

// TestListingNeverBlocksQemu: while a listing loop runs over the mount,
// qemu-img creates, converts, snapshots and writes images in the source
// folder, every time without a lock error.
func TestListingNeverBlocksQemu(t *testing.T) {
	requireFUSE(t)
	src := qemu.TempDir(t)
	base := filepath.Join(src, "base.qcow2")
	qemu.Create(t, "qcow2", base, "8M")
	m := mountImages(t, src)
	stop := make(chan struct{})
	listed := make(chan int)
	go func() {
		n := 0
		for {
			select {
			case <-stop:
				listed <- n
				return
			default:
			}
			entries, _ := os.ReadDir(m.Dir)
			for _, e := range entries {
				e.Info()
			}
			n++
		}
	}()
	for i := 0; i < 20; i++ {
		p := filepath.Join(src, fmt.Sprintf("new%d.qcow2", i))
		qemu.Create(t, "qcow2", p, "4M")
		qemu.IO(t, p, "write -P 0x22 0 64k")
		qemu.Img(t, "snapshot", "-c", "s", p)
		qemu.Img(t, "convert", "-O", "qcow2", p, filepath.Join(src, fmt.Sprintf("conv%d.qcow2", i)))
		qemu.IO(t, base, fmt.Sprintf("write -P %d %d 4k", i+1, i*4096))
	}
	close(stop)
	if n := <-listed; n == 0 {
		t.Fatal("the listing loop never completed a listing")
	}
}
