package harness

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

// ProcStats is what /proc says of a process (a daemon).
type ProcStats struct {
	RSSKB, HWMKB int64         // VmRSS, VmHWM
	FDs          int           // entries of /proc/PID/fd
	Files        int           // of which regular files and folders (not pipes, sockets, the FUSE device)
	CPU          time.Duration // user + system time
	Rchar        int64         // bytes read (/proc/PID/io)
}

func (s ProcStats) String() string {
	return fmt.Sprintf("RSS %d MiB (peak %d MiB), %d fds (%d files), %v CPU", s.RSSKB>>10, s.HWMKB>>10, s.FDs, s.Files, s.CPU.Round(time.Millisecond))
}

// ReadProc reads what /proc says of process pid; a process that is gone
// fails the test.
func ReadProc(t testing.TB, pid int) ProcStats {
	t.Helper()
	var s ProcStats
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatalf("the daemon (pid %d) is gone: %v", pid, err)
	}
	for _, line := range strings.Split(string(status), "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && (f[0] == "VmRSS:" || f[0] == "VmHWM:") {
			n, _ := strconv.ParseInt(f[1], 10, 64)
			if f[0] == "VmRSS:" {
				s.RSSKB = n
			} else {
				s.HWMKB = n
			}
		}
	}
	fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	s.FDs = len(fds)
	for _, fd := range fds {
		if target, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name())); err == nil &&
			strings.HasPrefix(target, "/") && target != "/dev/fuse" && !strings.HasPrefix(target, "/dev/null") {
			s.Files++
		}
	}
	if stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid)); err == nil {
		// Fields after the command name: 14 utime, 15 stime (clock
		// ticks, 100 a second on Linux).
		rest := string(stat[bytes.LastIndexByte(stat, ')')+2:])
		f := strings.Fields(rest)
		ut, _ := strconv.ParseInt(f[11], 10, 64)
		st, _ := strconv.ParseInt(f[12], 10, 64)
		s.CPU = time.Duration(ut+st) * 10 * time.Millisecond
	}
	if io, err := os.ReadFile(fmt.Sprintf("/proc/%d/io", pid)); err == nil {
		for _, line := range strings.Split(string(io), "\n") {
			if v, ok := strings.CutPrefix(line, "rchar: "); ok {
				s.Rchar, _ = strconv.ParseInt(v, 10, 64)
			}
		}
	}
	return s
}
