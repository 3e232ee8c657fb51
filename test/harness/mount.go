package harness

// Mounts made by the tests, their daemons and logs, and the mount table.

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/internal/mountinfo"
)

// A Mounted is a live qcowfs mount made by a test.
type Mounted struct {
	Dir  string // the mount point
	Log  string // the daemon's log file
	Said string // what qcowfs mount printed (refused images, warnings)
}

// A Daemon says how the daemon of a mount is started, beyond its flags.
type Daemon struct {
	// Racy: the race-detecting build, when there is one
	// (QCOWFS_TEST_RACE=1), for tests whose requests run concurrently
	// in the daemon. Main fails the run if it reports a race.
	Racy bool
	Env  []string // added to its environment (S3 keys)
	Wrap []string // a command that runs it (prlimit --nofile=...)
}

// Racy starts the race-detecting build when there is one.
var Racy = Daemon{Racy: true}

// mountTimeout bounds qcowfs mount, which returns once the first scan of
// the source is done, and qcowfs unmount, which returns once the daemon
// has written back and exited: either may take long, but not forever.
const mountTimeout = 5 * time.Minute

// Mount mounts src with `qcowfs mount` (as a daemon, the way users run
// it), with a debug log, and unmounts it when the test ends, even if it
// fails. A failed mount fails the test.
func Mount(t testing.TB, src string, args ...string) *Mounted {
	t.Helper()
	return Daemon{}.Mount(t, src, args...)
}

// Mount is Mount by the daemon d.
func (d Daemon) Mount(t testing.TB, src string, args ...string) *Mounted {
	t.Helper()
	m, out, err := d.TryMount(t, src, args...)
	if err != nil {
		t.Fatalf("qcowfs mount %s: %v\n%s", src, err, out)
	}
	return m
}

// TryMount is Mount returning the failure, with what qcowfs mount printed,
// instead of failing the test.
func (d Daemon) TryMount(t testing.TB, src string, args ...string) (*Mounted, string, error) {
	t.Helper()
	RequireFUSE(t)
	m := &Mounted{Dir: t.TempDir(), Log: filepath.Join(t.TempDir(), "qcowfs.log")}
	all := append(append(append([]string{"mount", "--log-file", m.Log, "--log-level", "debug"}, transportFlags()...), args...), src, m.Dir)
	qcowfs, env := bin, d.Env
	if d.Racy && raceBin != "" {
		qcowfs = raceBin
		env = append(env, "GORACE=log_path="+filepath.Join(raceDir, "report")+" halt_on_error=0")
	}
	cmd := exec.Command(qcowfs, all...)
	if len(d.Wrap) > 0 {
		cmd = exec.Command(d.Wrap[0], append(append(d.Wrap[1:], qcowfs), all...)...)
	}
	cmd.Env = append(os.Environ(), env...)
	r := RunCmdTimeout(t, cmd, mountTimeout)
	out := r.Stdout + r.Stderr
	if r.Code != 0 {
		if IsMounted(m.Dir) {
			t.Errorf("qcowfs mount failed (%d) but left %s mounted", r.Code, m.Dir)
			m.Unmount(t)
		}
		return nil, out, errors.New("exit status " + strconv.Itoa(r.Code))
	}
	m.Said = out
	t.Cleanup(func() { m.Unmount(t) })
	return m, out, nil
}

// Unmount unmounts, detaching lazily if something still holds the mount
// so that a failing test cannot leave it behind.
func (m *Mounted) Unmount(t testing.TB) {
	if !IsMounted(m.Dir) {
		return
	}
	if r := RunCmdTimeout(t, exec.Command(bin, "unmount", m.Dir), mountTimeout); r.Code != 0 {
		t.Logf("qcowfs unmount %s: exit status %d %s; detaching", m.Dir, r.Code, r.Stderr)
		exec.Command("umount", "-l", m.Dir).Run()
	}
}

// LogText returns the daemon's log so far.
func (m *Mounted) LogText(t testing.TB) string {
	b, err := os.ReadFile(m.Log)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

var pidRE = regexp.MustCompile(`msg=mounted .* pid=(\d+)`)

// PID is the process ID of the mount's daemon, from its log.
func (m *Mounted) PID(t testing.TB) int {
	t.Helper()
	sub := pidRE.FindStringSubmatch(m.LogText(t))
	if sub == nil {
		t.Fatalf("no pid in the log of %s", m.Dir)
	}
	pid, _ := strconv.Atoi(sub[1])
	return pid
}

// NoPanics fails the test if the daemon's log shows a recovered panic or
// a Go runtime crash.
func (m *Mounted) NoPanics(t testing.TB) {
	t.Helper()
	log := m.LogText(t)
	for _, w := range []string{"panic", "goroutine ", "fatal error"} {
		if strings.Contains(log, w) {
			t.Errorf("the daemon's log shows %q:\n%s", w, log)
			return
		}
	}
}

// IsMounted reports whether something is mounted on dir.
func IsMounted(dir string) bool {
	m, err := mountinfo.At(dir)
	return err == nil && m != nil
}

// Mounts reads /proc/self/mountinfo.
func Mounts(t testing.TB) []mountinfo.Mount {
	t.Helper()
	ms, err := mountinfo.Read()
	if err != nil {
		t.Fatal(err)
	}
	return ms
}

// MountsUnder returns the mounts on dir or below it, and the mounts whose
// source lies there.
func MountsUnder(t testing.TB, dir string) []mountinfo.Mount {
	t.Helper()
	var out []mountinfo.Mount
	in := func(p string) bool { return p == dir || strings.HasPrefix(p, dir+"/") }
	for _, m := range Mounts(t) {
		if in(m.Point) || in(m.Source) {
			out = append(out, m)
		}
	}
	return out
}

// MountAt returns the topmost mount on dir, or nil.
func MountAt(t testing.TB, dir string) *mountinfo.Mount {
	t.Helper()
	return mountinfo.Top(Mounts(t), dir)
}

// Daemons lists, with ps, the live (not zombie) qcowfs processes whose
// command line has path as an argument: the daemon or foreground process
// serving a mount on path. Matching on the test's unique temporary path
// keeps other tests' processes out.
func Daemons(t testing.TB, path string) []int {
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

// DaemonOf is the qcowfs process serving the mount on mnt (Daemons); none,
// or more than one, fails the test.
func DaemonOf(t testing.TB, mnt string) int {
	t.Helper()
	pids := Daemons(t, mnt)
	if len(pids) != 1 {
		t.Fatalf("want one qcowfs daemon for %s, have %v", mnt, pids)
	}
	return pids[0]
}

// Cleanup makes sure that, however the test ends, nothing stays mounted
// on mnt and no qcowfs process serving it survives: for mounts a test
// makes itself rather than with Mount.
func Cleanup(t testing.TB, mnt string) {
	t.Cleanup(func() {
		// Processes first, as one still starting could mount after
		// an unmount. SIGTERM lets a daemon unmount and exit; SIGKILL
		// is the last resort, as a daemon killed while it is in a
		// request on its own mount hangs until the connection is
		// aborted.
		signal := func(sig syscall.Signal, d time.Duration) {
			deadline := time.Now().Add(d)
			for pids := Daemons(t, mnt); len(pids) > 0 && time.Now().Before(deadline); pids = Daemons(t, mnt) {
				for _, pid := range pids {
					syscall.Kill(pid, sig)
				}
				time.Sleep(50 * time.Millisecond)
			}
		}
		conn := fuseConn(MountAt(t, mnt))
		signal(syscall.SIGTERM, 3*time.Second)
		// A connection that outlives its daemon's SIGTERM has a
		// request stuck in it: the daemon's own on its mount (a test
		// of that failing), which only an abort ends, and the readers
		// stuck with it.
		abortStuck(t, mnt, conn)
		for i := 0; i < 5 && MountAt(t, mnt) != nil; i++ {
			exec.Command("umount", "-l", mnt).Run()
		}
		signal(syscall.SIGKILL, 3*time.Second)
		abortStuck(t, mnt, conn)
		// The log a daemon without syslog and --log-file left.
		os.Remove(filepath.Join("/run/qcowfs", Escape(mnt)+".log"))
	})
}

// WantUnmount runs qcowfs unmount mnt, which must succeed and leave
// nothing mounted on mnt, and waits for the daemon to exit.
func WantUnmount(t testing.TB, mnt string) {
	t.Helper()
	WantOK(t, "qcowfs unmount "+mnt, Run(t, "unmount", mnt))
	if MountAt(t, mnt) != nil {
		t.Fatalf("%s still mounted after qcowfs unmount returned", mnt)
	}
	WaitGone(t, mnt)
}

// WaitGone waits for every qcowfs process serving mnt to exit.
func WaitGone(t testing.TB, mnt string) {
	t.Helper()
	WaitFor(t, "the qcowfs daemon for "+mnt+" to exit", 10*time.Second, func() bool {
		return len(Daemons(t, mnt)) == 0
	})
}

// Escape escapes a path as systemd-escape --path does, which is how
// qcowfs names a mount's files in its runtime folder.
func Escape(p string) string {
	out, err := exec.Command("systemd-escape", "--path", p).Output()
	if err == nil {
		return strings.TrimSpace(string(out))
	}
	// Without systemd: the same rules, for the plain paths of tests.
	return strings.ReplaceAll(strings.Trim(p, "/"), "/", "-")
}

// fusectl is where the kernel's FUSE control file system is mounted.
const fusectl = "/sys/fs/fuse/connections"

// fuseConn is the FUSE connection of the mount m (the minor number of its
// device), or "" if m is nil or no FUSE mount.
func fuseConn(m *mountinfo.Mount) string {
	if m == nil || !strings.HasPrefix(m.FSType, "fuse") {
		return ""
	}
	_, minor, _ := strings.Cut(m.MajMin, ":")
	return minor
}

// abortStuck aborts the FUSE connection conn of the mount on mnt if it is
// still there: still mounted on mnt, or detached (mounted nowhere) but
// alive, as a connection stays while a request waits in it. Every
// request waiting on it then fails (ENOTCONN): also those of a daemon
// stuck in a request on its own mount, which nothing else ends, not even
// kill -9. (A connection number mounted elsewhere is another mount's now,
// and left alone.)
func abortStuck(t testing.TB, mnt, conn string) {
	if conn == "" {
		return
	}
	if _, err := os.Stat(filepath.Join(fusectl, conn)); err != nil {
		if MountAt(t, fusectl) != nil {
			return // gone: nothing stuck
		}
		if syscall.Mount("fusectl", fusectl, "fusectl", 0, "") != nil {
			return
		}
		if _, err := os.Stat(filepath.Join(fusectl, conn)); err != nil {
			return
		}
	}
	if m := MountAt(t, mnt); fuseConn(m) != conn {
		for _, m := range Mounts(t) {
			if fuseConn(&m) == conn {
				return
			}
		}
	}
	t.Logf("aborting the FUSE connection %s of %s", conn, mnt)
	if err := os.WriteFile(filepath.Join(fusectl, conn, "abort"), []byte("1\n"), 0); err != nil {
		t.Logf("aborting the FUSE connection of %s: %v", mnt, err)
	}
}

// Watchdog aborts the mount's FUSE connection unless stop is called
// within d: a test that may deadlock the daemon then fails instead of
// hanging. It is a process of its own, since a deadlock can freeze the
// test's: a goroutine in a page fault of a mapping the daemon does not
// answer cannot be stopped by the Go runtime, and a garbage collection
// then waits for it for ever. Before aborting it prints the kernel stacks
// of the daemon's threads, where they wait, on the test's stderr. The
// abort fails whatever waits on the mount: a page fault with SIGBUS, which
// kills the test process.
func (m *Mounted) Watchdog(t testing.TB, d time.Duration) (stop func()) {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(m.Dir, &st); err != nil {
		t.Fatal(err)
	}
	abort := "/sys/fs/fuse/connections/" + strconv.FormatUint(uint64(unix.Minor(st.Dev)), 10) + "/abort"
	if _, err := os.Stat(abort); err != nil {
		t.Fatalf("watchdog: %v", err)
	}
	script := `sleep "$1"
echo "watchdog: the mount on $2 did not finish in $1 s: a deadlock? the daemon's threads in the kernel:" >&2
for s in /proc/"$3"/task/*/stack; do echo "$s:"; cat "$s"; done >&2
echo 1 > "$4"`
	cmd := exec.Command("sh", "-c", script, "watchdog", strconv.Itoa(int(d.Seconds())), m.Dir, strconv.Itoa(m.PID(t)), abort)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatalf("watchdog: %v", err)
	}
	stopped := false
	stop = func() {
		if !stopped {
			stopped = true
			syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			cmd.Wait()
		}
	}
	t.Cleanup(stop)
	return stop
}
