package qemu

// What qemu-img prints, as the oracle of what qcowfs prints in its place:
// a run's output and status (Output, ImgOutput), compared line by line
// (SameOutput); the page cache dropped before qemu-img map (DropCache).

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// An Output is what a run of qemu-img, or of the code under test in its
// place, printed, and its exit status.
type Output struct {
	Stdout, Stderr string
	Code           int
}

// ImgOutput runs qemu-img with args and returns what it printed and its
// exit status: only a failure to run it fails the test.
func ImgOutput(t testing.TB, args ...string) Output {
	t.Helper()
	Require(t, "qemu-img")
	var stdout, stderr bytes.Buffer
	cmd := exec.Command("qemu-img", args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatalf("qemu-img %s: %v", strings.Join(args, " "), err)
	}
	return Output{stdout.String(), stderr.String(), cmd.ProcessState.ExitCode()}
}

// SameOutput fails t unless the run us did what qemu-img's run q did: the
// same exit status, the same stdout, and on stderr the same lines (with
// prefix for qemu-img's "qemu-img: "), except where qemu could not open
// the image, whose reasons are ours to word (then both say something, or
// neither does).
func SameOutput(t testing.TB, what, prefix string, q, us Output) {
	t.Helper()
	if q.Code != us.Code {
		t.Errorf("%s: we exit %d, qemu-img %d\nqemu-img: %s\nwe:       %s", what, us.Code, q.Code, q.Stderr, us.Stderr)
		return
	}
	if d := diff(q.Stdout, us.Stdout); d != "" {
		t.Errorf("%s: we print something else than qemu-img, from %s", what, d)
	}
	if strings.Contains(q.Stderr, "Could not open") {
		if (q.Stderr == "") != (us.Stderr == "") {
			t.Errorf("%s: stderr: qemu-img %q, we %q", what, q.Stderr, us.Stderr)
		}
		return
	}
	if d := diff(strings.ReplaceAll(q.Stderr, "qemu-img: ", prefix), us.Stderr); d != "" {
		t.Errorf("%s: we say something else than qemu-img on stderr, from %s", what, d)
	}
}

// diff reports the first line where qemu-img's a and our b differ.
func diff(a, b string) string {
	al, bl := strings.Split(a, "\n"), strings.Split(b, "\n")
	for i := range max(len(al), len(bl)) {
		var x, y string
		if i < len(al) {
			x = al[i]
		}
		if i < len(bl) {
			y = bl[i]
		}
		if x != y {
			return fmt.Sprintf("line %d:\nqemu-img: %q\nwe:       %q", i+1, x, y)
		}
	}
	return ""
}

// DropCache drops the page cache of path before qemu-img map reads it:
// qemu's block status asks lseek(SEEK_DATA), which on ext4 counts cached
// pages over unwritten extents as data, where qcowfs asks FIEMAP; so that
// whatever read the image before does not decide what qemu says.
func DropCache(path string) {
	if f, err := os.Open(path); err == nil {
		f.Sync()
		unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
		f.Close()
	}
}
