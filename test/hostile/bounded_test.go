package test

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/qemu"
)

// The harness of the hostile tests (hostile*_test.go): every probe of a
// mount has a timeout, canary images sit beside the bad ones, the daemon's
// memory and descriptors are read from /proc, and `qcowfs info|map|check`
// run on every hostile image under `timeout` and GNU time.

// probe runs f, failing the test if it does not return within d: a
// hostile image must not hang the daemon.
func probe[T any](t testing.TB, what string, d time.Duration, f func() (T, error)) (T, error) {
	t.Helper()
	type result struct {
		v   T
		err error
	}
	ch := make(chan result, 1)
	go func() {
		v, err := f()
		ch <- result{v, err}
	}()
	select {
	case r := <-ch:
		return r.v, r.err
	case <-time.After(d):
		t.Fatalf("%s did not answer within %v", what, d)
		var zero T
		return zero, nil
	}
}

// listWithin lists dir (names, sorted) within d.
func listWithin(t testing.TB, dir string, d time.Duration) []string {
	t.Helper()
	got, err := probe(t, "listing "+dir, d, func() ([]string, error) {
		f, err := os.Open(dir)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		return f.Readdirnames(-1)
	})
	if err != nil {
		t.Fatalf("listing %s: %v", dir, err)
	}
	return got
}

var pidRE = regexp.MustCompile(`msg=mounted .* pid=(\d+)`)

// pid is the process ID of the mount's daemon, from its log.
func (m *mount) pid(t testing.TB) int {
	t.Helper()
	sub := pidRE.FindStringSubmatch(m.logText(t))
	if sub == nil {
		t.Fatalf("no pid in the log of %s", m.Dir)
	}
	pid, _ := strconv.Atoi(sub[1])
	return pid
}

// procStats is what /proc says of a process.
type procStats struct {
	rssKB, hwmKB int64         // VmRSS, VmHWM
	fds          int           // entries of /proc/PID/fd
	files        int           // of which regular files and folders (not pipes, sockets, the FUSE device)
	cpu          time.Duration // user + system time
	rchar        int64         // bytes read (/proc/PID/io)
}

func (s procStats) String() string {
	return fmt.Sprintf("RSS %d MiB (peak %d MiB), %d fds (%d files), %v CPU", s.rssKB>>10, s.hwmKB>>10, s.fds, s.files, s.cpu.Round(time.Millisecond))
}

func readProc(t testing.TB, pid int) procStats {
	t.Helper()
	var s procStats
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatalf("the daemon (pid %d) is gone: %v", pid, err)
	}
	for _, line := range strings.Split(string(status), "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && (f[0] == "VmRSS:" || f[0] == "VmHWM:") {
			n, _ := strconv.ParseInt(f[1], 10, 64)
			if f[0] == "VmRSS:" {
				s.rssKB = n
			} else {
				s.hwmKB = n
			}
		}
	}
	fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	s.fds = len(fds)
	for _, fd := range fds {
		if target, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name())); err == nil &&
			strings.HasPrefix(target, "/") && target != "/dev/fuse" && !strings.HasPrefix(target, "/dev/null") {
			s.files++
		}
	}
	if stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid)); err == nil {
		// Fields after the command name: 14 utime, 15 stime (clock
		// ticks, 100 a second on Linux).
		rest := string(stat[bytes.LastIndexByte(stat, ')')+2:])
		f := strings.Fields(rest)
		ut, _ := strconv.ParseInt(f[11], 10, 64)
		st, _ := strconv.ParseInt(f[12], 10, 64)
		s.cpu = time.Duration(ut+st) * 10 * time.Millisecond
	}
	if io, err := os.ReadFile(fmt.Sprintf("/proc/%d/io", pid)); err == nil {
		for _, line := range strings.Split(string(io), "\n") {
			if v, ok := strings.CutPrefix(line, "rchar: "); ok {
				s.rchar, _ = strconv.ParseInt(v, 10, 64)
			}
		}
	}
	return s
}

// noPanics fails the test if the daemon's log shows a recovered panic or
// a Go runtime crash.
func noPanics(t testing.TB, m *mount) {
	t.Helper()
	log := m.logText(t)
	for _, w := range []string{"panic", "goroutine ", "fatal error"} {
		if strings.Contains(log, w) {
			t.Errorf("the daemon's log shows %q:\n%s", w, log)
			return
		}
	}
}

// boundedRun is one bounded run of qcowfs info, map or check.
type boundedRun struct {
	code   int
	rssKB  int64
	wall   time.Duration
	stderr string
}

// memBound is a memory bound of mib MiB, in KiB, for a binary built as
// the tests build it: the race detector (make test) roughly triples what
// a program takes.
func memBound(mib int64) int64 {
	if raceDir != "" {
		mib *= 3
	}
	return mib << 10
}

// cliMaxRSS bounds the memory of one qcowfs info|map|check run on a
// hostile image (a function: TestMain decides about the race detector).
func cliMaxRSS() int64 { return memBound(192) }

// cliBounded runs `qcowfs info|map|check` on image under timeout and GNU
// time, and fails the test if one panics, is killed by the timeout or
// takes more than cliMaxRSS. It returns the three runs.
func cliBounded(t testing.TB, image string) map[string]boundedRun {
	t.Helper()
	qemu.Require(t, "/usr/bin/time", "timeout")
	out := map[string]boundedRun{}
	for _, cmd := range [][]string{{"info", "--output=json"}, {"map", "--output=json"}, {"check", "--output=json"}} {
		args := append([]string{"-f", "time: %M %e", "timeout", "-s", "KILL", "120", qcowfsBin}, append(cmd, image)...)
		c := exec.Command("/usr/bin/time", args...)
		var stderr bytes.Buffer
		c.Stdout, c.Stderr = nil, &stderr // the map of a hostile image can be large: not kept
		err := c.Run()
		r := boundedRun{code: exitCode(err)}
		text := stderr.String()
		if i := strings.LastIndex(text, "time: "); i >= 0 {
			var secs float64
			fmt.Sscanf(text[i:], "time: %d %f", &r.rssKB, &secs)
			r.wall = time.Duration(secs * float64(time.Second))
			text = text[:i]
		}
		r.stderr = text
		var ee *exec.ExitError
		switch {
		case errors.As(err, &ee) && (r.code == 124 || r.code == 137 || strings.Contains(text, "Command terminated by signal")):
			t.Errorf("qcowfs %s %s: killed or timed out (%v):\n%s", cmd[0], filepath.Base(image), err, text)
		case strings.Contains(text, "panic") || strings.Contains(text, "goroutine ") || strings.Contains(text, "fatal error"):
			t.Errorf("qcowfs %s %s crashed:\n%s", cmd[0], filepath.Base(image), text)
		case r.rssKB > cliMaxRSS():
			t.Errorf("qcowfs %s %s took %d MiB (bound %d MiB)", cmd[0], filepath.Base(image), r.rssKB>>10, cliMaxRSS()>>10)
		}
		out[cmd[0]] = r
	}
	return out
}

// cliBoundedAll runs cliBounded on every image, two at a time, and logs
// the largest memory and time of each command.
func cliBoundedAll(t testing.TB, images []string) {
	t.Helper()
	worst := map[string]boundedRun{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	work := make(chan string)
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for p := range work {
				runs := cliBounded(t, p)
				mu.Lock()
				for cmd, r := range runs {
					w := worst[cmd]
					w.rssKB, w.wall = max(w.rssKB, r.rssKB), max(w.wall, r.wall)
					worst[cmd] = w
				}
				mu.Unlock()
			}
		}()
	}
	for _, p := range images {
		work <- p
	}
	close(work)
	wg.Wait()
	for _, cmd := range []string{"info", "map", "check"} {
		t.Logf("qcowfs %s on %d hostile images: at most %d MiB, %v", cmd, len(images), worst[cmd].rssKB>>10, worst[cmd].wall.Round(time.Millisecond))
	}
}

// errIs reports whether err is errno.
func errIs(err error, errno syscall.Errno) bool { return errors.Is(err, errno) }
