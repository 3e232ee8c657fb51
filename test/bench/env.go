package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/qcowfs/qcowfs/internal/mountinfo"
)

// An env is the machine side of a run: the work folder, the commands run in
// it, and what is set up there (the tmpfs, servers), torn down last first
// when the bench ends, also on failure and on Ctrl-C. The run loop knows it
// only through setup (targets.go) and run.
type env struct {
	ctx  context.Context
	cfg  config
	log  *os.File
	lock *os.File

	mu    sync.Mutex // guards undo and seq
	undo  []func()
	seq   int
	tmpfs bool     // tmpfsDir is mounted
	net   *network // the servers of the remote workloads (remote.go)

	// kept are the targets of a workload that keeps its mounts across
	// rounds (workload.keep), by contestant id; keptFor is its id.
	kept    map[string]*target
	keptFor string
}

func newEnv(ctx context.Context, cfg config) (*env, error) {
	if err := os.MkdirAll(filepath.Join(cfg.work, "logs"), 0o755); err != nil {
		return nil, err
	}
	// One run per work folder: a second would sweep the first one's mounts.
	lock, err := os.OpenFile(filepath.Join(cfg.work, "bench.lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		lock.Close()
		return nil, fmt.Errorf("another bench is using %s: %v", cfg.work, err)
	}
	log, err := os.Create(filepath.Join(cfg.work, "logs", "bench-"+time.Now().Format("20060102-150405")+".log"))
	if err != nil {
		lock.Close()
		return nil, err
	}
	e := &env{ctx: ctx, cfg: cfg, log: log, lock: lock}
	e.sweep(cfg.work) // what a run killed outright left behind
	return e, os.RemoveAll(filepath.Join(cfg.work, "run"))
}

// onClose registers f to run when the bench ends, last registered first.
func (e *env) onClose(f func()) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.undo = append(e.undo, f)
}

func (e *env) close() {
	e.releaseKept()
	e.mu.Lock()
	undo := e.undo
	e.undo = nil
	e.mu.Unlock()
	for i := len(undo) - 1; i >= 0; i-- {
		undo[i]()
	}
	e.sweep(e.cfg.work)
	e.log.Close()
	e.lock.Close()
}

// logf writes a line to the run's log.
func (e *env) logf(format string, args ...any) {
	e.mu.Lock()
	defer e.mu.Unlock()
	fmt.Fprintf(e.log, time.Now().Format("15:04:05.000 ")+format+"\n", args...)
}

// scratch is a fresh folder under the work folder.
func (e *env) scratch(name string) (string, error) {
	e.mu.Lock()
	e.seq++
	dir := filepath.Join(e.cfg.work, "run", fmt.Sprintf("%03d-%s", e.seq, name))
	e.mu.Unlock()
	return dir, os.MkdirAll(dir, 0o755)
}

// preamble is prepended to every command: bash stops at the first failure,
// also inside a pipeline. lap runs a command and prints "@NAME SECONDS",
// for commands that time parts of themselves (run.go reads @ lines).
// luks runs a qemu-img that makes a LUKS header, again while it fails
// timing PBKDF2 ("Unable to get accurate CPU usage", a busy machine's).
const preamble = `set -eo pipefail
dropcaches() { echo 3 > /proc/sys/vm/drop_caches; }
luks() { local i out; for i in $(seq 50); do out=$("$@" 2>&1) && return; [[ $out == *"accurate CPU usage"* ]] || break; done; echo "$out" >&2; return 1; }
lap() { local t=${EPOCHREALTIME/./}; eval "$2"; echo "@$1 $(( ${EPOCHREALTIME/./} - t ))e-6"; }
`

// A job is one bash command: its script, its variables and its time limit.
type job struct {
	script  string
	vars    []string      // NAME=value, added to the environment
	limit   time.Duration // 0: ten minutes
	cleanup bool          // runs even after the bench was interrupted
}

// An exit is how a job went.
type exit struct {
	stdout, stderr string
	secs           float64
	timedOut       bool
	err            error // nil, or why it failed, with the end of its stderr
}

// run runs j in a process group of its own, so that a timeout kills the
// whole pipeline and the terminal's Ctrl-C reaches none of it before the
// bench has unmounted what it uses.
func (e *env) run(j job) exit {
	ctx := e.ctx
	if j.cleanup {
		ctx = context.Background()
	}
	if j.limit == 0 {
		j.limit = 10 * time.Minute
	}
	ctx, cancel := context.WithTimeout(ctx, j.limit)
	defer cancel()
	c := exec.CommandContext(ctx, "bash", "-c", preamble+j.script)
	c.Env = append(os.Environ(), j.vars...)
	c.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	c.Cancel = func() error { return syscall.Kill(-c.Process.Pid, syscall.SIGKILL) }
	// A process blocked on a hung FUSE daemon keeps the pipes open until
	// its connection is aborted (target.close): do not wait for it here.
	c.WaitDelay = 5 * time.Second
	var stdout, stderr bytes.Buffer
	c.Stdout, c.Stderr = &stdout, &stderr
	e.logf("$ %s %s", strings.Join(j.vars, " "), j.script)
	start := time.Now()
	err := c.Run()
	x := exit{stdout: stdout.String(), stderr: stderr.String(), secs: time.Since(start).Seconds()}
	switch {
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		x.timedOut = true
		x.err = fmt.Errorf("timed out (> %v)", j.limit)
	case err != nil && e.ctx.Err() != nil && !j.cleanup:
		x.err = errors.New("interrupted")
	case err != nil:
		x.err = fmt.Errorf("%v: %s", err, why(x.stderr+x.stdout))
	}
	if x.err != nil {
		e.logf("  -> %v", x.err)
	}
	return x
}

// sh runs a script and returns its stdout.
func (e *env) sh(script string, vars ...string) (string, error) {
	x := e.run(job{script: script, vars: vars})
	return x.stdout, x.err
}

// why is the first line of a failed command's output that says "error",
// or else its last lines.
func why(out string) string {
	for _, line := range strings.Split(out, "\n") {
		if strings.Contains(strings.ToLower(line), "error") {
			return strings.TrimSpace(line)
		}
	}
	return tail(out, 3)
}

// tail is the last n non-empty lines of s, on one line.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], " | ")
}

// dropCaches drops the clean page cache, dentries and inodes: the next
// read of an image comes from the disk, or through its daemon. Not a
// sync first: the machine's other work may have gigabytes dirty, and the
// images are not.
func dropCaches() error {
	return os.WriteFile("/proc/sys/vm/drop_caches", []byte("3\n"), 0)
}

func mounts() []mountinfo.Mount {
	ms, _ := mountinfo.Read()
	return ms
}

func isMounted(p string) bool { return mountinfo.Top(mounts(), p) != nil }

// sweep removes what is left under dir: mounts of other file systems (a
// guest's ext4), loop devices over files there, FUSE mounts (aborted if
// they do not go), and processes whose arguments name something there.
func (e *env) sweep(dir string) {
	prefix := dir + "/"
	under := func(fuse bool) {
		ms := mounts()
		for i := len(ms) - 1; i >= 0; i-- {
			if strings.HasPrefix(ms[i].Point, prefix) && strings.HasPrefix(ms[i].FSType, "fuse") == fuse {
				e.logf("sweep: unmounting %s (%s)", ms[i].Point, ms[i].FSType)
				e.forceUnmount(ms[i].Point)
			}
		}
	}
	under(false)
	out, _ := exec.Command("losetup", "--list", "--noheadings", "-O", "NAME,BACK-FILE").Output()
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) == 2 && strings.HasPrefix(f[1], prefix) {
			e.logf("sweep: detaching %s (%s)", f[0], f[1])
			exec.Command("partx", "-d", f[0]).Run()
			exec.Command("losetup", "-d", f[0]).Run()
		}
	}
	under(true)
	for _, pid := range pidsNaming(prefix) {
		if !waitGone(pid, 2*time.Second) {
			e.logf("sweep: killing pid %d", pid)
			syscall.Kill(pid, syscall.SIGKILL)
			waitGone(pid, 5*time.Second)
		}
	}
}

// forceUnmount unmounts point however it can: plainly, then with its FUSE
// connection aborted (every request waiting on a hung daemon fails), lazily.
func (e *env) forceUnmount(point string) {
	if syscall.Unmount(point, 0) == nil || !isMounted(point) {
		return
	}
	e.abortFUSE(point)
	for i := 0; i < 10 && isMounted(point); i++ {
		syscall.Unmount(point, syscall.MNT_DETACH)
	}
}

const fusectl = "/sys/fs/fuse/connections"

// abortFUSE aborts the FUSE connection of the mount at point, if it is one.
func (e *env) abortFUSE(point string) {
	m := mountinfo.Top(mounts(), point)
	if m == nil || !strings.HasPrefix(m.FSType, "fuse") {
		return
	}
	_, minor, _ := strings.Cut(m.MajMin, ":")
	if !isMounted(fusectl) && syscall.Mount("fusectl", fusectl, "fusectl", 0, "") == nil {
		e.onClose(func() { syscall.Unmount(fusectl, 0) })
	}
	e.logf("aborting FUSE connection %s of %s", minor, point)
	os.WriteFile(filepath.Join(fusectl, minor, "abort"), []byte("1\n"), 0)
}

// pidsNaming lists the processes (not this one) with an argument that
// contains s.
func pidsNaming(s string) []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, d := range ents {
		pid, err := strconv.Atoi(d.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		b, _ := os.ReadFile(filepath.Join("/proc", d.Name(), "cmdline"))
		if bytes.Contains(b, []byte(s)) && alive(pid) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// alive says whether pid exists and is not a zombie.
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(b, ')') // the state follows the name
	return i < 0 || i+2 >= len(b) || b[i+2] != 'Z'
}

func waitGone(pid int, d time.Duration) bool {
	return waitFor(d, func() bool { return !alive(pid) })
}

// waitFor polls cond every 20 ms for up to d.
func waitFor(d time.Duration, cond func() bool) bool {
	for end := time.Now().Add(d); !cond(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(end) {
			return false
		}
	}
	return true
}
