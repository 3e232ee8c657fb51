package harness

// Running commands: the binary under test, qemu-img beside it, any other
// tool, each with a timeout; the shape of a user error.

import (
	"bytes"
	"encoding/json"
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/qemu"
)

// Timeout bounds every command a test runs (RunCmd), so that a hang (a
// mount that never reports ready, a helper that stays in the foreground)
// fails the test instead of stalling the run.
const Timeout = 60 * time.Second

// A Result is what a finished command printed, and its exit status.
type Result struct {
	Stdout, Stderr string
	Code           int
}

// RunCmd runs cmd within Timeout, separating stdout from stderr. A
// command that cannot start or does not end in time fails the test; one
// that exits non-zero does not (its Code says so).
func RunCmd(t testing.TB, cmd *exec.Cmd) Result {
	t.Helper()
	return RunCmdTimeout(t, cmd, Timeout)
}

// RunCmdTimeout is RunCmd within d.
func RunCmdTimeout(t testing.TB, cmd *exec.Cmd, d time.Duration) Result {
	t.Helper()
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	// A daemon that kept our pipes open must not block Wait.
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Start(); err != nil {
		t.Fatalf("%s: %v", cmd, err)
	}
	timer := time.AfterFunc(d, func() { cmd.Process.Kill() })
	err := cmd.Wait()
	if !timer.Stop() {
		t.Fatalf("%s: still running after %v; killed it\nstdout: %s\nstderr: %s", cmd, d, &stdout, &stderr)
	}
	r := Result{Stdout: stdout.String(), Stderr: stderr.String()}
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		r.Code = ee.ExitCode()
	default:
		t.Fatalf("%s: %v\nstderr: %s", cmd, err, &stderr)
	}
	return r
}

// Exec runs the tool name with args within Timeout (RunCmd).
func Exec(t testing.TB, name string, args ...string) Result {
	t.Helper()
	return RunCmd(t, exec.Command(name, args...))
}

// Run runs the qcowfs binary under test with args.
func Run(t testing.TB, args ...string) Result {
	t.Helper()
	return RunCmd(t, exec.Command(bin, args...))
}

// WantOK fails the test unless r is a success.
func WantOK(t testing.TB, what string, r Result) {
	t.Helper()
	if r.Code != 0 {
		t.Fatalf("%s: exit status %d\nstdout: %s\nstderr: %s", what, r.Code, r.Stdout, r.Stderr)
	}
}

// WantError checks the shape of a user error: a non-zero exit, nothing
// on stdout, and on stderr a single line "qcowfs: ..." that contains every
// one of words.
func WantError(t testing.TB, what string, r Result, words ...string) {
	t.Helper()
	if r.Code == 0 {
		t.Errorf("%s: exit status 0, want an error\nstderr: %s", what, r.Stderr)
	}
	if r.Stdout != "" {
		t.Errorf("%s: printed on stdout: %q", what, r.Stdout)
	}
	if !strings.HasPrefix(r.Stderr, "qcowfs: ") || !strings.HasSuffix(r.Stderr, "\n") ||
		strings.Count(r.Stderr, "\n") != 1 {
		t.Errorf("%s: stderr is not one line starting with \"qcowfs: \": %q", what, r.Stderr)
	}
	for _, w := range words {
		if !strings.Contains(r.Stderr, w) {
			t.Errorf("%s: stderr %q does not mention %q", what, r.Stderr, w)
		}
	}
}

// Both runs qemu-img and qcowfs with the same arguments in dir: the
// oracle of qcowfs info, map and check. Before a map, the image's pages
// are dropped (qemu.DropCache), so that whatever read the image before
// (another command here) does not decide what qemu says.
func Both(t testing.TB, dir string, args ...string) (q, us Result) {
	t.Helper()
	if args[0] == "map" {
		p := args[len(args)-1]
		if !filepath.IsAbs(p) {
			p = filepath.Join(dir, p)
		}
		qemu.DropCache(p)
	}
	qc := exec.Command("qemu-img", args...)
	qc.Dir = dir
	uc := exec.Command(bin, args...)
	uc.Dir = dir
	return RunCmd(t, qc), RunCmd(t, uc)
}

// SameAsQemu fails t unless qcowfs's run us did what qemu-img's run q did
// (Both), as qemu.SameOutput says, with "qcowfs: " for "qemu-img: ".
func SameAsQemu(t testing.TB, what string, q, us Result) {
	t.Helper()
	qemu.SameOutput(t, what, "qcowfs: ", qemu.Output(q), qemu.Output(us))
}

// JSON decodes what the run printed on stdout into v; output that is not
// JSON fails the test.
func (r Result) JSON(t testing.TB, v any) {
	t.Helper()
	if err := json.Unmarshal([]byte(r.Stdout), v); err != nil {
		t.Fatalf("not JSON (exit status %d): %v\n%s%s", r.Code, err, r.Stdout, r.Stderr)
	}
}
