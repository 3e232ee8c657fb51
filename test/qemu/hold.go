package qemu

import (
	"io"
	"os/exec"
	"strings"
	"testing"
)

// HoldOpen starts qemu-io on image (read-write) and keeps it running, so
// that it holds qemu's locks, until the test ends or release is called;
// it returns the pid of that qemu-io.
func HoldOpen(t testing.TB, image string) (pid int, release func()) {
	t.Helper()
	Require(t, "qemu-io")
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
	return cmd.Process.Pid, release
}

// WantLocked fails the test unless qemu's tool (qemu-img or qemu-io), run
// with args on an image that something holds, fails saying want: its
// lock error, such as `Failed to get "write" lock`.
func WantLocked(t testing.TB, want, tool string, args ...string) {
	t.Helper()
	Require(t, tool)
	out, err := exec.Command(tool, args...).CombinedOutput()
	if err == nil || !strings.Contains(string(out), want) {
		t.Errorf("%s %s: %v, %s; want qemu's lock error %q", tool, strings.Join(args, " "), err, out, want)
	}
}
