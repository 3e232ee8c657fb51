package test

// End-to-end tests of the qcowfs command line: user errors, daemon and
// foreground mounts, signals, unmount, the mount(8) helper convention and
// fstab, info against qemu-img info, version and help.
//
// Helpers here are prefixed with "cli" so they do not collide with the
// rest of the package.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

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

// A cliMount is one line of /proc/self/mountinfo.
type cliMount struct {
	Point, FSType, Source, SuperOpts string
}

// cliMounts parses /proc/self/mountinfo.
func cliMounts(t testing.TB) []cliMount {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var out []cliMount
	for _, line := range strings.Split(string(b), "\n") {
		// ID parent major:minor root point options [optional...] - fstype source superopts
		f := strings.Fields(line)
		if len(f) < 7 {
			continue
		}
		m := cliMount{Point: cliUnescape(f[4])}
		for i := 6; i+3 < len(f); i++ {
			if f[i] == "-" {
				m.FSType, m.Source, m.SuperOpts = f[i+1], cliUnescape(f[i+2]), f[i+3]
				break
			}
		}
		out = append(out, m)
	}
	return out
}

// cliUnescape undoes mountinfo's octal escapes (\040 for a space, ...).
func cliUnescape(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// cliMountsUnder returns the mounts on dir or below it, and the mounts
// whose source lies there.
func cliMountsUnder(t testing.TB, dir string) []cliMount {
	t.Helper()
	var out []cliMount
	in := func(p string) bool { return p == dir || strings.HasPrefix(p, dir+"/") }
	for _, m := range cliMounts(t) {
		if in(m.Point) || in(m.Source) {
			out = append(out, m)
		}
	}
	return out
}

// cliMountAt returns the topmost mount on dir, or nil.
func cliMountAt(t testing.TB, dir string) *cliMount {
	t.Helper()
	var top *cliMount
	for _, m := range cliMounts(t) {
		if m.Point == dir {
			m := m
			top = &m
		}
	}
	return top
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

// TestCLIErrors: every user mistake is one line on stderr, a non-zero
// exit, no mount and no daemon.
func TestCLIErrors(t *testing.T) {
	requireFUSE(t)
	root := t.TempDir()
	src := cliMkdir(t, root, "images")
	cliImage(t, src, "vm")
	notImage := cliWrite(t, filepath.Join(root, "notimage.qcow2"), strings.Repeat("not a qcow2 image\n", 1000))
	regular := cliWrite(t, filepath.Join(root, "file"), "a regular file\n")
	mnt := cliMkdir(t, root, "mnt")
	inside := cliMkdir(t, src, "sub")
	tmpfs := cliMkdir(t, root, "tmpfs")
	cliTmpfs(t, tmpfs)
	qcowMnt := mountImages(t, src).Dir
	// A source inside the mount point: the mount would hide it from the
	// daemon itself.
	outer := cliMkdir(t, root, "outer")
	hiddenSrc := cliMkdir(t, outer, "images")
	cliImage(t, hiddenSrc, "hidden")

	cases := []struct {
		name  string
		args  []string
		mnt   string
		words []string
	}{
		{"SRC missing", []string{"mount", filepath.Join(root, "nosuch"), mnt}, mnt, []string{"nosuch"}},
		{"SRC missing foreground", []string{"mount", "--foreground", filepath.Join(root, "nosuch"), mnt}, mnt, []string{"nosuch"}},
		{"MNT missing", []string{"mount", src, filepath.Join(root, "nomnt")}, filepath.Join(root, "nomnt"), []string{"nomnt"}},
		{"MNT regular file", []string{"mount", src, regular}, regular, []string{regular, "not a folder"}},
		{"MNT tmpfs mount", []string{"mount", src, tmpfs}, tmpfs, []string{"already a mount point"}},
		{"MNT qcowfs mount", []string{"mount", src, qcowMnt}, qcowMnt, []string{"already a mount point"}},
		{"MNT inside SRC", []string{"mount", src, inside}, inside, []string{"inside"}},
		{"MNT is SRC", []string{"mount", src, src}, src, []string{"inside"}},
		{"SRC inside MNT", []string{"mount", hiddenSrc, outer}, outer, []string{"inside"}},
		{"SRC not qcow2", []string{"mount", notImage, mnt}, mnt, []string{notImage, "not a qcow2 image"}},
		{"unknown option", []string{"mount", "-o", "ro,bogus", src, mnt}, mnt, []string{"bogus"}},
		{"unknown option helper", []string{src, mnt, "-o", "ro,allow_other,bogus"}, mnt, []string{"bogus"}},
		{"bad option value", []string{"mount", "-o", "l2_cache_size=lots", src, mnt}, mnt, []string{"l2_cache_size"}},
		// Found by the daemon, after the checks of the waiting parent:
		// its reason must still reach the user.
		{"log file unwritable", []string{"mount", "--log-file", filepath.Join(root, "nodir", "x.log"), src, mnt}, mnt, []string{"log file", "nodir"}},
	}
	for _, c := range cases {
		t.Run(strings.ReplaceAll(c.name, " ", "_"), func(t *testing.T) {
			cliCleanup(t, c.mnt)
			mountsBefore := cliMountsUnder(t, root)
			daemonsBefore := cliDaemons(t, c.mnt)
			// Errors are found before anything is mounted: quickly.
			r := cliRunCmdTimeout(t, exec.Command(qcowfsBin, c.args...), 20*time.Second)
			cliWantError(t, "qcowfs "+strings.Join(c.args, " "), r, c.words...)
			if after := cliMountsUnder(t, root); !reflect.DeepEqual(after, mountsBefore) {
				t.Errorf("mounts under %s changed:\nbefore %v\nafter  %v", root, mountsBefore, after)
			}
			if after := cliDaemons(t, c.mnt); !reflect.DeepEqual(after, daemonsBefore) {
				t.Errorf("qcowfs processes for %s: before %v, after %v", c.mnt, daemonsBefore, after)
			}
		})
	}

	// Command line syntax errors: kong prints the command's usage on
	// stdout, and the reason as one line on stderr.
	for _, args := range [][]string{{"mount", src}, {"mount", "--no-such-flag", src, mnt}, {"mount", "--log-level", "loud", src, mnt}, {"frobnicate"}} {
		r := cliRun(t, args...)
		if r.code == 0 || !strings.HasPrefix(r.stderr, "qcowfs: ") || strings.Count(r.stderr, "\n") != 1 {
			t.Errorf("qcowfs %s: status %d, stderr %q; want an error, in one line", strings.Join(args, " "), r.code, r.stderr)
		}
		if m := cliMountsUnder(t, mnt); len(m) != 0 {
			t.Errorf("qcowfs %s mounted %v", strings.Join(args, " "), m)
		}
	}

	// Non-root without fusermount3: the binary run as nobody with a PATH
	// that has no fusermount3 in it.
	t.Run("not_root_without_fusermount3", func(t *testing.T) {
		setpriv, err := exec.LookPath("setpriv")
		if err != nil {
			t.Skip("setpriv not installed")
		}
		nobody, err := user.Lookup("nobody")
		if err != nil {
			t.Skip("no user nobody")
		}
		d := t.TempDir()
		// nobody must reach the binary, the source and the mount point.
		for _, p := range []string{d, filepath.Dir(d)} {
			if err := os.Chmod(p, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		bin := filepath.Join(d, "qcowfs")
		b, err := os.ReadFile(qcowfsBin)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(bin, b, 0o755); err != nil {
			t.Fatal(err)
		}
		src := cliMkdir(t, d, "images")
		img, _ := cliImage(t, src, "vm")
		os.Chmod(img, 0o644)
		mnt := cliMkdir(t, d, "mnt")
		emptyBin := cliMkdir(t, d, "bin")
		cliCleanup(t, mnt)
		for _, args := range [][]string{{"mount", src, mnt}, {src, mnt, "-o", "ro"}} {
			cmd := exec.Command(setpriv, append([]string{"--reuid=" + nobody.Uid, "--regid=" + nobody.Gid, "--clear-groups", bin}, args...)...)
			cmd.Env = []string{"PATH=" + emptyBin}
			r := cliRunCmd(t, cmd)
			cliWantError(t, "qcowfs "+strings.Join(args, " ")+" as nobody", r, "fusermount3")
			if m := cliMountsUnder(t, d); len(m) != 0 {
				t.Errorf("mounted: %v", m)
			}
			if p := cliDaemons(t, mnt); len(p) != 0 {
				t.Errorf("qcowfs processes left: %v", p)
			}
		}
	})
}

// TestCLIDaemonReady: "qcowfs mount" returns only once the mount is live.
// The checks right after it returns do not poll: the mount must be there.
func TestCLIDaemonReady(t *testing.T) {
	requireFUSE(t)
	src := t.TempDir()
	img, raw := cliImage(t, src, "vm")
	logFile := filepath.Join(t.TempDir(), "qcowfs.log")
	for i, source := range []string{src, src, img, img} {
		mnt := t.TempDir()
		cliCleanup(t, mnt)
		r := cliRun(t, "mount", "--log-file", logFile, source, mnt)
		cliWantOK(t, "qcowfs mount", r)
		if r.stdout != "" || r.stderr != "" {
			t.Errorf("qcowfs mount printed %q, %q; want silence", r.stdout, r.stderr)
		}
		m := cliMountAt(t, mnt)
		if m == nil || m.FSType != "fuse.qcowfs" {
			t.Fatalf("round %d: right after qcowfs mount returned, %s is mounted as %+v, want fuse.qcowfs", i, mnt, m)
		}
		if m.Source != source {
			t.Errorf("mount source %q, want %q", m.Source, source)
		}
		sameFile(t, filepath.Join(mnt, "vm.raw"), raw)
		cliWantOK(t, "qcowfs unmount", cliRun(t, "unmount", mnt))
		if cliMountAt(t, mnt) != nil {
			t.Fatalf("%s still mounted after qcowfs unmount returned", mnt)
		}
		cliWaitGone(t, mnt)
	}
}

// A cliForeground is a "qcowfs mount --foreground" process.
type cliForeground struct {
	cmd  *exec.Cmd
	done chan struct{}
	err  error  // Wait's result, once done is closed
	log  string // its stderr
}

func cliStartForeground(t testing.TB, src, mnt string) *cliForeground {
	t.Helper()
	cliCleanup(t, mnt)
	p := &cliForeground{done: make(chan struct{}), log: filepath.Join(t.TempDir(), "stderr")}
	logf, err := os.Create(p.log)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	p.cmd = exec.Command(qcowfsBin, "mount", "--foreground", "--log-level", "debug", src, mnt)
	p.cmd.Stdout, p.cmd.Stderr = logf, logf
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		if !p.exited() {
			p.cmd.Process.Kill()
			<-p.done
		}
	})
	waitFor(t, "the foreground mount", 10*time.Second, func() bool { return isMounted(mnt) || p.exited() })
	if p.exited() {
		t.Fatalf("qcowfs mount --foreground exited: %v\n%s", p.err, p.stderr(t))
	}
	if m := cliMountAt(t, mnt); m.FSType != "fuse.qcowfs" {
		t.Fatalf("%s mounted as %s", mnt, m.FSType)
	}
	return p
}

func (p *cliForeground) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (p *cliForeground) stderr(t testing.TB) string {
	b, _ := os.ReadFile(p.log)
	return string(b)
}

// wait waits for the process to exit and checks that it exited 0.
func (p *cliForeground) wait(t testing.TB, why string) {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(15 * time.Second):
		t.Fatalf("qcowfs --foreground still running 15s after %s\n%s", why, p.stderr(t))
	}
	if p.err != nil {
		t.Fatalf("qcowfs --foreground after %s: %v, want exit status 0\n%s", why, p.err, p.stderr(t))
	}
}

// TestForegroundSignals: SIGTERM and SIGINT unmount and end a foreground
// mount with status 0, even while a file is held open.
func TestForegroundSignals(t *testing.T) {
	requireFUSE(t)
	src := t.TempDir()
	_, raw := cliImage(t, src, "vm")
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
		t.Run(sig.String(), func(t *testing.T) {
			mnt := t.TempDir()
			p := cliStartForeground(t, src, mnt)
			sameFile(t, filepath.Join(mnt, "vm.raw"), raw)
			if err := p.cmd.Process.Signal(sig); err != nil {
				t.Fatal(err)
			}
			p.wait(t, sig.String())
			if isMounted(mnt) {
				t.Fatalf("%s still mounted after qcowfs exited", mnt)
			}
		})
	}

	t.Run("busy", func(t *testing.T) {
		mnt := t.TempDir()
		p := cliStartForeground(t, src, mnt)
		f, err := os.Open(filepath.Join(mnt, "vm.raw"))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "the busy mount to be detached", 10*time.Second, func() bool { return !isMounted(mnt) })
		// Detached, but the open file still reads, served by the
		// process, which must keep running until it is closed.
		want, err := os.ReadFile(raw)
		if err != nil {
			t.Fatal(err)
		}
		got := make([]byte, 200000)
		if n, err := f.ReadAt(got, 1200000); err != nil || !bytes.Equal(got[:n], want[1200000:1200000+n]) {
			t.Errorf("reading the open file after the detach: %d bytes, %v, or wrong bytes", n, err)
		}
		if p.exited() {
			t.Fatalf("qcowfs exited (%v) while a file was open\n%s", p.err, p.stderr(t))
		}
		f.Close()
		p.wait(t, "SIGTERM and closing the last open file")
	})
}

// TestUnmount: "qcowfs unmount" unmounts qcowfs mounts and refuses
// anything else.
func TestUnmount(t *testing.T) {
	requireFUSE(t)
	src := t.TempDir()
	cliImage(t, src, "vm")

	t.Run("qcowfs", func(t *testing.T) {
		m := mountImages(t, src)
		cliCleanup(t, m.Dir)
		if len(cliDaemons(t, m.Dir)) != 1 {
			t.Fatalf("want one daemon for %s, have %v", m.Dir, cliDaemons(t, m.Dir))
		}
		r := cliRun(t, "unmount", m.Dir)
		cliWantOK(t, "qcowfs unmount", r)
		if r.stdout != "" || r.stderr != "" {
			t.Errorf("qcowfs unmount printed %q, %q; want silence", r.stdout, r.stderr)
		}
		if isMounted(m.Dir) {
			t.Fatalf("%s still mounted after qcowfs unmount", m.Dir)
		}
		cliWaitGone(t, m.Dir)
	})

	t.Run("relative_path_and_umount_alias", func(t *testing.T) {
		m := mountImages(t, src)
		cliCleanup(t, m.Dir)
		cmd := exec.Command(qcowfsBin, "umount", filepath.Base(m.Dir))
		cmd.Dir = filepath.Dir(m.Dir)
		cliWantOK(t, "qcowfs umount DIR (relative)", cliRunCmd(t, cmd))
		if isMounted(m.Dir) {
			t.Fatalf("%s still mounted", m.Dir)
		}
		cliWaitGone(t, m.Dir)
	})

	t.Run("busy", func(t *testing.T) {
		m := mountImages(t, src)
		cliCleanup(t, m.Dir)
		f, err := os.Open(filepath.Join(m.Dir, "vm.raw"))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		cliWantError(t, "qcowfs unmount (busy)", cliRun(t, "unmount", m.Dir), "busy", "--lazy")
		if !isMounted(m.Dir) {
			t.Fatalf("a refused unmount unmounted %s", m.Dir)
		}
		cliWantOK(t, "qcowfs unmount --lazy", cliRun(t, "unmount", "--lazy", m.Dir))
		if isMounted(m.Dir) {
			t.Fatalf("%s still mounted after unmount --lazy", m.Dir)
		}
		f.Close()
		cliWaitGone(t, m.Dir)
	})

	t.Run("not_a_mount", func(t *testing.T) {
		dir := t.TempDir()
		cliWantError(t, "qcowfs unmount (not mounted)", cliRun(t, "unmount", dir), dir, "not mounted")
		missing := filepath.Join(dir, "nosuch")
		cliWantError(t, "qcowfs unmount (missing)", cliRun(t, "unmount", missing), missing, "not mounted")
	})

	t.Run("tmpfs", func(t *testing.T) {
		dir := t.TempDir()
		cliTmpfs(t, dir)
		cliWantError(t, "qcowfs unmount (tmpfs)", cliRun(t, "unmount", dir), dir, "tmpfs", "not a qcowfs")
		if m := cliMountAt(t, dir); m == nil || m.FSType != "tmpfs" {
			t.Fatalf("the tmpfs on %s is gone: %+v", dir, m)
		}
	})
}

// cliHelperNamespace prepares for running mount(8) the way users do, with
// qcowfs installed where mount(8) finds it, without touching the system:
//
// mount(8) runs its helpers with an empty environment (util-linux 2.38
// drops PATH), so /sbin/mount.fuse3 finds "qcowfs" only in /bin/sh's
// default path (/usr/local/sbin:/usr/local/bin:/usr/sbin:...), whatever
// PATH the test sets. So the command runs in a private mount namespace in
// which a folder holding a qcowfs symlink is bind-mounted over
// /usr/local/sbin. The mount point lies in a folder bind-mounted shared,
// so that the FUSE mount made in that namespace appears in ours, where
// the test checks it and unmounts it with plain umount.
//
// It returns the shared folder, for the mount point, and a function that
// runs a command in such a namespace.
func cliHelperNamespace(t *testing.T) (string, func(args ...string) cliResult) {
	t.Helper()
	requireFUSE(t)
	for _, tool := range []string{"mount", "umount", "unshare", "findmnt", "/sbin/mount.fuse3"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not installed", tool)
		}
	}
	sbin := "/usr/local/sbin"
	if st, err := os.Stat(sbin); err != nil || !st.IsDir() {
		sbin = "/usr/local/bin"
	}
	if _, err := os.Stat(filepath.Join(sbin, "qcowfs")); err == nil {
		t.Logf("%s/qcowfs exists; hidden by the bind mount in the test namespace", sbin)
	}
	shared := t.TempDir()
	for _, args := range [][]string{{"--bind", shared, shared}, {"--make-shared", shared}} {
		if out, err := exec.Command("mount", args...).CombinedOutput(); err != nil {
			t.Fatalf("mount %v: %v %s", args, err, out)
		}
	}
	// Registered first, so it runs after the mount point's cleanup.
	t.Cleanup(func() { exec.Command("umount", "-l", shared).Run() })
	bin := t.TempDir()
	if err := os.Symlink(qcowfsBin, filepath.Join(bin, "qcowfs")); err != nil {
		t.Fatal(err)
	}
	const script = `set -e
# Keep the bind mount over $2 in this namespace: make the mount it lands
# on private here (not recursively: the shared folder stays shared).
mount --make-private "$(findmnt -n -o TARGET --target "$2")"
mount --bind "$1" "$2"
shift 2
exec "$@"`
	run := func(args ...string) cliResult {
		t.Helper()
		cmd := exec.Command("unshare", append([]string{"--mount", "--propagation", "unchanged",
			"sh", "-c", script, "sh", bin, sbin}, args...)...)
		// qcowfs first in PATH too, as a user would have it;
		// mount(8) drops PATH before running mount.fuse3 anyway.
		cmd.Env = append(os.Environ(), "PATH="+filepath.Dir(qcowfsBin)+":"+os.Getenv("PATH"))
		return cliRunCmd(t, cmd)
	}
	return shared, run
}

// cliCheckHelperMount checks a mount made by mount(8): live, a qcowfs
// daemon behind it, allow_other and read-only as asked, and the image's
// bytes as qemu-img convert makes them. Then plain umount unmounts it and
// the daemon exits.
func cliCheckHelperMount(t *testing.T, mnt, src, raw string) {
	t.Helper()
	m := cliMountAt(t, mnt)
	if m == nil || m.FSType != "fuse.qcowfs" {
		t.Fatalf("%s: mounted as %+v, want fuse.qcowfs", mnt, m)
	}
	if m.Source != src {
		t.Errorf("mount source %q, want %q", m.Source, src)
	}
	opts := strings.Split(m.SuperOpts, ",")
	for _, o := range []string{"ro", "allow_other"} {
		if !cliContains(opts, o) {
			t.Errorf("mount options %s lack %s", m.SuperOpts, o)
		}
	}
	daemons := cliDaemons(t, mnt)
	if len(daemons) != 1 {
		t.Fatalf("want one qcowfs daemon for %s, have %v", mnt, daemons)
	}
	if exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", daemons[0])); err != nil || exe != qcowfsBin {
		t.Errorf("the daemon runs %q (%v), want the binary under test %s", exe, err, qcowfsBin)
	}
	sameFile(t, filepath.Join(mnt, "vm.raw"), raw)
	if out, err := exec.Command("umount", mnt).CombinedOutput(); err != nil {
		t.Fatalf("umount %s: %v %s", mnt, err, out)
	}
	if isMounted(mnt) {
		t.Fatalf("%s still mounted after umount", mnt)
	}
	cliWaitGone(t, mnt)
}

func cliContains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// TestHelperMount: mount -t fuse.qcowfs SRC MNT -o ro,allow_other, which
// mount(8) turns into /sbin/mount.fuse3 ..., which runs qcowfs SRC MNT -o
// ro,allow_other,dev,suid.
func TestHelperMount(t *testing.T) {
	shared, run := cliHelperNamespace(t)
	src := t.TempDir()
	_, raw := cliImage(t, src, "vm")
	mnt := cliMkdir(t, shared, "mnt")
	cliCleanup(t, mnt)
	r := run("mount", "-t", "fuse.qcowfs", src, mnt, "-o", "ro,allow_other")
	cliWantOK(t, "mount -t fuse.qcowfs", r)
	cliCheckHelperMount(t, mnt, src, raw)
}

// TestFstabMount: an fstab line "SRC MNT fuse.qcowfs ro,allow_other 0 0",
// from a private fstab file (mount --fstab), not /etc/fstab.
func TestFstabMount(t *testing.T) {
	shared, run := cliHelperNamespace(t)
	src := t.TempDir()
	_, raw := cliImage(t, src, "vm")
	mnt := cliMkdir(t, shared, "mnt")
	cliCleanup(t, mnt)
	esc := strings.NewReplacer(" ", `\040`, "\t", `\011`, `\`, `\134`).Replace
	fstab := cliWrite(t, filepath.Join(t.TempDir(), "fstab"),
		fmt.Sprintf("# qcowfs test\n%s %s fuse.qcowfs ro,allow_other 0 0\n", esc(src), esc(mnt)))
	r := run("mount", "--fstab", fstab, mnt)
	cliWantOK(t, "mount --fstab", r)
	cliCheckHelperMount(t, mnt, src, raw)
}

// TestHelperAsMountQcowfs: installed as /sbin/mount.qcowfs, qcowfs is run
// by mount(8) directly, with mount(8)'s own flags: -s, -n, -v, -o OPTS, -t
// TYPE (for a helper whose name does not end with the type) and -f (fake:
// record the mount, do nothing). argv[0] is what tells qcowfs.
func TestHelperAsMountQcowfs(t *testing.T) {
	requireFUSE(t)
	src := t.TempDir()
	_, raw := cliImage(t, src, "vm")
	helper := func(args ...string) *exec.Cmd {
		cmd := exec.Command(qcowfsBin, args...)
		cmd.Args[0] = "/sbin/mount.qcowfs"
		return cmd
	}

	mnt := t.TempDir()
	cliCleanup(t, mnt)
	cliWantOK(t, "mount.qcowfs", cliRunCmd(t, helper(src, mnt, "-s", "-n", "-v", "-o", "ro,allow_other,noatime", "-t", "fuse.qcowfs")))
	cliCheckHelperMount(t, mnt, src, raw)

	// mount -f: nothing is mounted, nothing stays running. (Were -f
	// taken for --foreground, this would mount and never return.)
	mnt = t.TempDir()
	cliCleanup(t, mnt)
	r := cliRunCmdTimeout(t, helper(src, mnt, "-f", "-o", "ro"), 10*time.Second)
	cliWantOK(t, "mount.qcowfs -f", r)
	if isMounted(mnt) {
		t.Errorf("mount.qcowfs -f (fake) mounted %s", mnt)
	}
	if p := cliDaemons(t, mnt); len(p) != 0 {
		t.Errorf("mount.qcowfs -f left processes %v", p)
	}
	// Options are still checked.
	cliWantError(t, "mount.qcowfs -f -o bogus", cliRunCmd(t, helper(src, mnt, "-f", "-o", "bogus")), "bogus")
}

// cliCompareJSON compares qcowfs's decoded JSON with qemu's, recursively,
// on the keys qemu prints, and reports keys only qcowfs prints.
func cliCompareJSON(t *testing.T, path string, got, want map[string]any) {
	t.Helper()
	for k, w := range want {
		g, ok := got[k]
		if !ok {
			// qemu 8.0 and later print "children", the image's
			// protocol-level nodes (the file it lives in); qcowfs
			// describes the image only. qemu 7.2 does not print it.
			if k == "children" {
				continue
			}
			t.Errorf("%s: qcowfs info lacks %q (qemu-img: %v)", path, k, w)
			continue
		}
		wm, wok := w.(map[string]any)
		gm, gok := g.(map[string]any)
		if wok && gok {
			cliCompareJSON(t, path+"/"+k, gm, wm)
			continue
		}
		if !reflect.DeepEqual(g, w) {
			t.Errorf("%s: %q is %#v, qemu-img says %#v", path, k, g, w)
		}
	}
	for k, g := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("%s: qcowfs info prints %q (%v), qemu-img does not", path, k, g)
		}
	}
}

// cliInfoJSON runs "qcowfs info --output=json" in dir (if not empty).
func cliInfoJSON(t *testing.T, dir, image string) map[string]any {
	t.Helper()
	cmd := exec.Command(qcowfsBin, "info", "--output=json", image)
	cmd.Dir = dir
	r := cliRunCmd(t, cmd)
	cliWantOK(t, "qcowfs info --output=json "+image, r)
	var m map[string]any
	if err := json.Unmarshal([]byte(r.stdout), &m); err != nil {
		t.Fatalf("qcowfs info --output=json %s: %v\n%s", image, err, r.stdout)
	}
	return m
}

// cliQemuInfo runs qemu-img info with format "json" or "human" in dir.
func cliQemuInfo(t *testing.T, dir, format, image string) string {
	t.Helper()
	cmd := exec.Command("qemu-img", "info", "--output="+format, image)
	cmd.Dir = dir
	r := cliRunCmd(t, cmd)
	if r.code != 0 {
		t.Fatalf("qemu-img info %s: %s", image, r.stderr)
	}
	return r.stdout
}

// cliSetIncompat sets bits of a qcow2 header's incompatible features
// (bytes 72-79, big-endian): 1 is dirty, 2 is corrupt. qemu-img info then
// says what it makes of the result.
func cliSetIncompat(t *testing.T, path string, bits byte) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var b [1]byte
	if _, err := f.ReadAt(b[:], 79); err != nil {
		t.Fatal(err)
	}
	b[0] |= bits
	if _, err := f.WriteAt(b[:], 79); err != nil {
		t.Fatal(err)
	}
}

// TestInfoMatchesQemu: "qcowfs info" says what "qemu-img info" says, in
// JSON for every image of the matrix and a few more, and line for line in
// the human format for some.
func TestInfoMatchesQemu(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	dir := qemu.TempDir(t)
	images := qemu.Matrix(t, dir)

	// Header bits qemu-img info reports: dirty (v3 with lazy refcounts)
	// and corrupt.
	dirty := filepath.Join(dir, "dirty.qcow2")
	qemu.Create(t, "qcow2", dirty, "1M", "-o", "lazy_refcounts=on")
	qemu.IO(t, dirty, "write -P 0x12 0 4k")
	cliSetIncompat(t, dirty, 1)
	corrupt := filepath.Join(dir, "corrupt.qcow2")
	qemu.Create(t, "qcow2", corrupt, "1M")
	qemu.IO(t, corrupt, "write -P 0x12 0 4k")
	cliSetIncompat(t, corrupt, 2)
	// Other compression, refcount width and an absolute backing name.
	zstd := filepath.Join(dir, "zstd.qcow2")
	qemu.Create(t, "qcow2", zstd, "3M", "-o", "compression_type=zstd,refcount_bits=1,extended_l2=on,cluster_size=16384", "-b", images[0].Path, "-F", "qcow2")
	images = append(images, qemu.Image{Name: "dirty", Path: dirty}, qemu.Image{Name: "corrupt", Path: corrupt}, qemu.Image{Name: "zstd", Path: zstd})

	for _, im := range images {
		t.Run("json/"+im.Name, func(t *testing.T) {
			var want map[string]any
			if err := json.Unmarshal([]byte(cliQemuInfo(t, "", "json", im.Path)), &want); err != nil {
				t.Fatal(err)
			}
			cliCompareJSON(t, im.Name, cliInfoJSON(t, "", im.Path), want)
		})
	}

	// Relative names: "filename" and "full-backing-filename" are what
	// qemu-img makes of the name it is given.
	t.Run("json/relative", func(t *testing.T) {
		for _, name := range []string{"chain-top.qcow2", "./chain-mid.qcow2"} {
			var want map[string]any
			if err := json.Unmarshal([]byte(cliQemuInfo(t, dir, "json", name)), &want); err != nil {
				t.Fatal(err)
			}
			cliCompareJSON(t, name, cliInfoJSON(t, dir, name), want)
		}
	})

	human := map[string]bool{"v2-c512": true, "v3-c65536": true, "compressed-c4096": true,
		"chain-top": true, "over-compressed": true, "prealloc": true, "dirty": true, "corrupt": true, "zstd": true,
		"datafile-raw-on": true, "datafile-raw-off": true}
	for _, im := range images {
		if !human[im.Name] {
			continue
		}
		t.Run("human/"+im.Name, func(t *testing.T) {
			want := strings.Split(strings.TrimSuffix(cliQemuInfo(t, "", "human", im.Path), "\n"), "\n")
			r := cliRun(t, "info", im.Path)
			cliWantOK(t, "qcowfs info", r)
			got := strings.Split(strings.TrimSuffix(r.stdout, "\n"), "\n")
			if missing, extra := cliLineDiff(got, want); len(missing)+len(extra) > 0 {
				t.Errorf("qcowfs info %s differs from qemu-img info:\nonly qemu-img: %q\nonly qcowfs:   %q", im.Path, missing, extra)
			}
		})
	}

	// qemu-img info does not open the backing file, so it describes an
	// overlay whose backing file is gone.
	t.Run("json/missing_backing", func(t *testing.T) {
		d := t.TempDir()
		base := filepath.Join(d, "base.qcow2")
		over := filepath.Join(d, "over.qcow2")
		qemu.Create(t, "qcow2", base, "1M")
		qemu.Create(t, "qcow2", over, "1M", "-b", "base.qcow2", "-F", "qcow2")
		os.Remove(base)
		var want map[string]any
		if err := json.Unmarshal([]byte(cliQemuInfo(t, "", "json", over)), &want); err != nil {
			t.Fatal(err)
		}
		r := cliRun(t, "info", "--output=json", over)
		cliWantOK(t, "qcowfs info (missing backing file)", r)
		var got map[string]any
		if err := json.Unmarshal([]byte(r.stdout), &got); err != nil {
			t.Fatal(err)
		}
		cliCompareJSON(t, "over", got, want)
	})
}

// cliLineDiff returns the lines only in want and only in got, as sets.
func cliLineDiff(got, want []string) (missing, extra []string) {
	count := map[string]int{}
	for _, l := range want {
		count[l]++
	}
	for _, l := range got {
		count[l]--
	}
	for l, n := range count {
		for ; n > 0; n-- {
			missing = append(missing, l)
		}
		for ; n < 0; n++ {
			extra = append(extra, l)
		}
	}
	sort.Strings(missing)
	sort.Strings(extra)
	return missing, extra
}

// TestInfoErrors: info on something that is not an image says why in one
// line and fails.
func TestInfoErrors(t *testing.T) {
	dir := t.TempDir()
	notImage := cliWrite(t, filepath.Join(dir, "notimage.qcow2"), strings.Repeat("not a qcow2 image\n", 1000))
	empty := cliWrite(t, filepath.Join(dir, "empty.qcow2"), "")
	missing := filepath.Join(dir, "nosuch.qcow2")
	// Encrypted images are refused with the encryption method named.
	luks := filepath.Join(dir, "luks.qcow2")
	aes := filepath.Join(dir, "aes.qcow2")
	qemu.CreateEncrypted(t, luks, "luks")
	qemu.CreateEncrypted(t, aes, "aes")
	for _, c := range []struct {
		path  string
		words []string
	}{
		{notImage, []string{notImage, "not a qcow2 image"}},
		{empty, []string{empty}},
		{missing, []string{missing, "no such file"}},
		{dir, []string{dir}},
		{luks, []string{luks, "encrypted (luks): not supported"}},
		{aes, []string{aes, "encrypted (aes): not supported"}},
	} {
		for _, format := range []string{"human", "json"} {
			r := cliRun(t, "info", "--output="+format, c.path)
			cliWantError(t, "qcowfs info --output="+format+" "+c.path, r, c.words...)
		}
	}
}

// TestVersionHelp: version and help.
func TestVersionHelp(t *testing.T) {
	r := cliRun(t, "version")
	cliWantOK(t, "qcowfs version", r)
	if !regexp.MustCompile(`^qcowfs \S+\n$`).MatchString(r.stdout) || r.stderr != "" {
		t.Errorf("qcowfs version printed %q, %q; want \"qcowfs VERSION\\n\"", r.stdout, r.stderr)
	}
	if r2 := cliRun(t, "--version"); r2.code != 0 || r2.stdout != r.stdout {
		t.Errorf("qcowfs --version printed %q (status %d), qcowfs version %q", r2.stdout, r2.code, r.stdout)
	}

	// The version is set at build time with -ldflags -X main.version.
	bin := filepath.Join(t.TempDir(), "qcowfs")
	build := exec.Command("go", "build", "-ldflags", "-X main.version=v9.8.7-test", "-o", bin, "../cmd/qcowfs")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	r = cliRunCmd(t, exec.Command(bin, "version"))
	if r.code != 0 || r.stdout != "qcowfs v9.8.7-test\n" {
		t.Errorf("built with -X main.version=v9.8.7-test, qcowfs version printed %q (status %d)", r.stdout, r.code)
	}

	r = cliRun(t, "--help")
	cliWantOK(t, "qcowfs --help", r)
	for _, cmd := range []string{"mount", "unmount", "info", "version"} {
		if !regexp.MustCompile(`(?m)^\s+` + cmd + `\b`).MatchString(r.stdout) {
			t.Errorf("qcowfs --help does not list the %s command:\n%s", cmd, r.stdout)
		}
	}

	// Every flag of mount, and every -o option it documents.
	flags := []string{"-f", "--foreground", "--allow-other", "--l2-cache-size", "--log-level",
		"--log-file", "--debug", "-o", "--options"}
	options := []string{"ro", "allow_other", "l2_cache_size", "log_level", "log_file", "debug", "foreground"}
	r = cliRun(t, "mount", "--help")
	cliWantOK(t, "qcowfs mount --help", r)
	for _, f := range flags {
		if !regexp.MustCompile(`(^|[\s,])` + regexp.QuoteMeta(f) + `([\s=,]|$)`).MatchString(r.stdout) {
			t.Errorf("qcowfs mount --help does not mention %s:\n%s", f, r.stdout)
		}
	}
	for _, o := range options {
		if !regexp.MustCompile(`\b` + o + `\b`).MatchString(r.stdout) {
			t.Errorf("qcowfs mount --help does not mention -o %s", o)
		}
	}
	// The flags as the help spells them are the ones the parser takes:
	// with all of them, the error is about the missing source, not a
	// flag.
	nosuch := filepath.Join(t.TempDir(), "nosuch")
	args := []string{"mount", "-f", "--foreground", "--allow-other", "--l2-cache-size", "16M", "--log-level", "warn",
		"--log-file", filepath.Join(t.TempDir(), "log"), "--debug", "-o", "ro", "--options", "allow_other", nosuch, t.TempDir()}
	cliWantError(t, "qcowfs "+strings.Join(args, " "), cliRun(t, args...), "nosuch")
}
