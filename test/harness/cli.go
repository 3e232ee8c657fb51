package test

// Helpers of the command line tests (cli_*_test.go): running the binary
// under test with a timeout, the shape of a user error, mounts and daemons
// left behind, small images.
//
// Helpers here are prefixed with "cli" so they do not collide with the
// rest of the package.

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/internal/mountinfo"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// cliTimeout bounds every command a test runs, so that a hang (a mount
// that never reports ready, a helper that stays in the foreground) fails
// the test instead of stalling the run.
const cliTimeout = 60 * time.Second

// cliResult is what a finished command printed and its exit status.
type cliResult struct {
	stdout, stderr string
	code           int
}

// cliRunCmd runs cmd with cliTimeout, separating stdout from stderr.
func cliRunCmd(t testing.TB, cmd *exec.Cmd) cliResult {
	t.Helper()
	return cliRunCmdTimeout(t, cmd, cliTimeout)
}

func cliRunCmdTimeout(t testing.TB, cmd *exec.Cmd, d time.Duration) cliResult {
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
	r := cliResult{stdout: stdout.String(), stderr: stderr.String()}
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		r.code = ee.ExitCode()
	default:
		t.Fatalf("%s: %v\nstderr: %s", cmd, err, &stderr)
	}
	return r
}

// cliRun runs the qcowfs binary under test.
func cliRun(t testing.TB, args ...string) cliResult {
	t.Helper()
	return cliRunCmd(t, exec.Command(qcowfsBin, args...))
}

// cliWantOK fails the test unless r is a success.
func cliWantOK(t testing.TB, what string, r cliResult) {
	t.Helper()
	if r.code != 0 {
		t.Fatalf("%s: exit status %d\nstdout: %s\nstderr: %s", what, r.code, r.stdout, r.stderr)
	}
}

// cliWantError checks the shape of a user error: a non-zero exit, nothing
// on stdout, and on stderr a single line "qcowfs: ..." that contains every
// one of words.
func cliWantError(t testing.TB, what string, r cliResult, words ...string) {
	t.Helper()
	if r.code == 0 {
		t.Errorf("%s: exit status 0, want an error\nstderr: %s", what, r.stderr)
	}
	if r.stdout != "" {
		t.Errorf("%s: printed on stdout: %q", what, r.stdout)
	}
	if !strings.HasPrefix(r.stderr, "qcowfs: ") || !strings.HasSuffix(r.stderr, "\n") ||
		strings.Count(r.stderr, "\n") != 1 {
		t.Errorf("%s: stderr is not one line starting with \"qcowfs: \": %q", what, r.stderr)
	}
	for _, w := range words {
		if !strings.Contains(r.stderr, w) {
			t.Errorf("%s: stderr %q does not mention %q", what, r.stderr, w)
		}
	}
}

// cliMounts reads /proc/self/mountinfo.
func cliMounts(t testing.TB) []mountinfo.Mount {
	t.Helper()
	ms, err := mountinfo.Read()
	if err != nil {
		t.Fatal(err)
	}
	return ms
}

// cliMountsUnder returns the mounts on dir or below it, and the mounts
// whose source lies there.
func cliMountsUnder(t testing.TB, dir string) []mountinfo.Mount {
	t.Helper()
	var out []mountinfo.Mount
	in := func(p string) bool { return p == dir || strings.HasPrefix(p, dir+"/") }
	for _, m := range cliMounts(t) {
		if in(m.Point) || in(m.Source) {
			out = append(out, m)
		}
	}
	return out
}

// cliMountAt returns the topmost mount on dir, or nil.
func cliMountAt(t testing.TB, dir string) *mountinfo.Mount {
	t.Helper()
	return mountinfo.Top(cliMounts(t), dir)
}

// cliDaemons lists, with ps, the live (not zombie) qcowfs processes whose
// command line has path as an argument: the daemon or foreground process
// serving a mount on path. Matching on the test's unique temporary path
// keeps other tests' processes out.
func cliDaemons(t testing.TB, path string) []int {
	t.Helper()
	out, err := exec.Command("ps", "-ww", "-eo", "pid=,stat=,args=").Output()
	if err != nil {
		t.Fatalf("ps: %v", err)
	}
	var pids []int
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) < 4 || strings.HasPrefix(f[1], "Z") || !strings.Contains(filepath.Base(f[2]), "qcowfs") {
			continue
		}
		for _, a := range f[3:] {
			if a == path {
				pid, _ := strconv.Atoi(f[0])
				pids = append(pids, pid)
				break
			}
		}
	}
	return pids
}

// cliCleanup makes sure that, however the test ends, nothing stays mounted
// on mnt and no qcowfs process serving it survives.
func cliCleanup(t testing.TB, mnt string) {
	t.Cleanup(func() {
		// Processes first, as one still starting could mount after
		// an unmount. SIGTERM lets a daemon unmount and exit; SIGKILL
		// is the last resort, as a daemon killed while it is in a
		// request on its own mount hangs until the connection is
		// aborted.
		signal := func(sig syscall.Signal, d time.Duration) {
			deadline := time.Now().Add(d)
			for pids := cliDaemons(t, mnt); len(pids) > 0 && time.Now().Before(deadline); pids = cliDaemons(t, mnt) {
				for _, pid := range pids {
					syscall.Kill(pid, sig)
				}
				time.Sleep(50 * time.Millisecond)
			}
		}
		signal(syscall.SIGTERM, 3*time.Second)
		for i := 0; i < 5 && cliMountAt(t, mnt) != nil; i++ {
			exec.Command("umount", "-l", mnt).Run()
		}
		signal(syscall.SIGKILL, 3*time.Second)
		// The log a daemon without syslog and --log-file left.
		os.Remove(filepath.Join("/run/qcowfs", cliEscape(mnt)+".log"))
	})
}

// cliWaitGone waits for every qcowfs process serving mnt to exit.
func cliWaitGone(t testing.TB, mnt string) {
	t.Helper()
	waitFor(t, "the qcowfs daemon for "+mnt+" to exit", 10*time.Second, func() bool {
		return len(cliDaemons(t, mnt)) == 0
	})
}

// cliImage makes a small image with data, zeros and holes in dir and
// returns its path and what qemu-img convert -O raw makes of it.
func cliImage(t testing.TB, dir, name string) (img, raw string) {
	t.Helper()
	img = filepath.Join(dir, name+".qcow2")
	qemu.Create(t, "qcow2", img, "4M", "-o", "cluster_size=4096")
	qemu.IO(t, img, "write -P 0x5a 0 64k", "write -P 0xa5 1234567 100000", "write -z 2M 64k")
	raw = qemu.ToRaw(t, img, filepath.Join(t.TempDir(), name+".raw"))
	return img, raw
}

// cliTmpfs mounts a tmpfs on dir until the test ends.
func cliTmpfs(t testing.TB, dir string) {
	t.Helper()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=1m", "qcowfs-test", dir).CombinedOutput(); err != nil {
		t.Fatalf("mount tmpfs: %v %s", err, out)
	}
	t.Cleanup(func() { exec.Command("umount", "-l", dir).Run() })
}

func cliMkdir(t testing.TB, parts ...string) string {
	t.Helper()
	d := filepath.Join(parts...)
	if err := os.MkdirAll(d, 0o755); err != nil {
		t.Fatal(err)
	}
	return d
}

func cliWrite(t testing.TB, path, text string) string {
	t.Helper()
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func cliContains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// cliEscape escapes a path as systemd-escape --path does, which is how
// qcowfs names a mount's files in its runtime folder.
func cliEscape(p string) string {
	out, err := exec.Command("systemd-escape", "--path", p).Output()
	if err == nil {
		return strings.TrimSpace(string(out))
	}
	// Without systemd: the same rules, for the plain paths of tests.
	return strings.ReplaceAll(strings.Trim(p, "/"), "/", "-")
}
