package test

import (
	"io"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

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

// TestLockMountedImage: while an image is shown, qemu cannot open it for
// writing (qemu's own error) but can still read it, as with any reader.
func TestLockMountedImage(t *testing.T) {
	requireFUSE(t)
	src := qemu.TempDir(t)
	img := filepath.Join(src, "vm.qcow2")
	qemu.Create(t, "qcow2", img, "4M")
	m := mountImages(t, src)
	if got := names(t, m.Dir); !slices.Equal(got, []string{"vm.raw"}) {
		t.Fatalf("lists %q", got)
	}
	out, err := exec.Command("qemu-io", "-f", "qcow2", "-c", "write 0 4k", img).CombinedOutput()
	if err == nil || !strings.Contains(string(out), `Failed to get "write" lock`) {
		t.Errorf("qemu-io writing a mounted image: %v, %s; want qemu's write lock error", err, out)
	}
	if out, err := exec.Command("qemu-img", "info", img).CombinedOutput(); err != nil {
		t.Errorf("qemu-img info (a reader) on a mounted image: %v, %s", err, out)
	}
	m.unmount(t)
	if out, err := exec.Command("qemu-io", "-f", "qcow2", "-c", "write 0 4k", img).CombinedOutput(); err != nil {
		t.Errorf("qemu-io after unmount: %v, %s", err, out)
	}
}
