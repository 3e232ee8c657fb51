package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/qcowfs/qcowfs/internal/mountinfo"
)

// mounts lists the mounts this process sees (none if mountinfo cannot be
// read: the bench then finds nothing left over to clean up).
func mounts() []mountinfo.Mount {
	ms, _ := mountinfo.Read()
	return ms
}

// mountAt returns the topmost mount at path, or nil.
func mountAt(path string) *mountinfo.Mount { return mountinfo.Top(mounts(), path) }

func isMounted(path string) bool { return mountAt(path) != nil }

// dropCaches writes back dirty data and drops the page cache, dentries and
// inodes, so that the next read comes from the disk (or, for a FUSE file,
// from its daemon).
func dropCaches() error {
	syscall.Sync()
	return os.WriteFile("/proc/sys/vm/drop_caches", []byte("3\n"), 0)
}

// fusectlDir is where the kernel shows FUSE connections.
const fusectlDir = "/sys/fs/fuse/connections"

// abortFUSE aborts the FUSE connection of the mount at point: every request
// waiting on its daemon fails with ENOTCONN and every later one too, so
// nothing stays blocked on a daemon that hangs. It mounts fusectl when it
// is not mounted (and remembers to unmount it at the end).
func (b *bench) abortFUSE(point string) error {
	m := mountAt(point)
	if m == nil || !strings.HasPrefix(m.FSType, "fuse") {
		return nil
	}
	_, minor, ok := strings.Cut(m.MajMin, ":")
	if !ok {
		return fmt.Errorf("%s: odd device %q in mountinfo", point, m.MajMin)
	}
	if _, err := os.Stat(filepath.Join(fusectlDir, minor)); err != nil {
		if !isMounted(fusectlDir) {
			if err := syscall.Mount("fusectl", fusectlDir, "fusectl", 0, ""); err != nil {
				return fmt.Errorf("mounting fusectl on %s: %w", fusectlDir, err)
			}
			b.mountedFusectl = true
		}
	}
	fmt.Fprintf(b.log, "aborting FUSE connection %s of %s\n", minor, point)
	return os.WriteFile(filepath.Join(fusectlDir, minor, "abort"), []byte("1\n"), 0)
}

// forceUnmount gets rid of the mount at point however it can: a plain
// unmount, then aborting its FUSE connection and detaching it lazily.
func (b *bench) forceUnmount(point string) error {
	if !isMounted(point) {
		return nil
	}
	if syscall.Unmount(point, 0) == nil && !isMounted(point) {
		return nil
	}
	if err := b.abortFUSE(point); err != nil {
		fmt.Fprintf(b.log, "abort %s: %v\n", point, err)
	}
	for i := 0; i < 10 && isMounted(point); i++ {
		syscall.Unmount(point, syscall.MNT_DETACH)
	}
	if isMounted(point) {
		return fmt.Errorf("%s: still mounted after a lazy unmount", point)
	}
	return nil
}

// procAlive reports whether pid exists and is not a zombie.
func procAlive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// The state follows the command name, which is in parentheses.
	s := string(b)
	if i := strings.LastIndexByte(s, ')'); i >= 0 && i+2 < len(s) {
		return s[i+2] != 'Z'
	}
	return true
}

// waitGone waits up to d for pid to exit.
func waitGone(pid int, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for procAlive(pid) {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
	return true
}

// findDaemon returns the pid of a process whose executable's base name is
// exe and whose arguments include arg (an absolute mount point): how the
// daemons that detach themselves (qcowfs, qcowmount) are found again.
func findDaemon(exe, arg string) int {
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil || len(b) == 0 {
			continue
		}
		argv := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		if filepath.Base(argv[0]) != exe {
			continue
		}
		for _, a := range argv[1:] {
			if a == arg {
				if procAlive(pid) {
					return pid
				}
			}
		}
	}
	return 0
}

// peakRSS returns a process's peak resident set size (VmHWM) in bytes.
func peakRSS(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			f := strings.Fields(v)
			if len(f) == 2 && f[1] == "kB" {
				n, err := strconv.ParseInt(f[0], 10, 64)
				return n << 10, err
			}
		}
	}
	return 0, fmt.Errorf("pid %d: no VmHWM in /proc/%d/status", pid, pid)
}
