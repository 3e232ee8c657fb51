// Package procinfo names the processes behind what the kernel reports
// without one, from /proc (proc(5)): who holds a byte-range lock on a file
// (qemu's image locks are open file description locks, which F_OFD_GETLK
// reports with a pid of -1, as /proc/locks does), and who serves a FUSE
// mount. It walks the descriptors of every process it may look at, so it
// is for messages about a conflict, not for a hot path.
package procinfo

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/internal/mountinfo"
)

// A Process is one process as /proc shows it.
type Process struct {
	PID     int
	Command string // the program: the last element of argv[0], else comm
	// Mount and FSType are the mount point and type of a FUSE file
	// system the process serves, when this process sees the mount and
	// the kernel names the connection of a /dev/fuse descriptor in its
	// fdinfo ("fuse_connection:"; older kernels do not); else "".
	Mount, FSType string
}

// String names p for a message: "qemu-system-x86_64 (pid 4242)";
// "another qcowfs (pid 4242, mounted at /mnt/vms)" for a qcowfs daemon
// (one that serves a fuse.qcowfs mount, or is a program named qcowfs);
// "this qcowfs (pid 4242)" for the caller itself.
func (p Process) String() string {
	switch {
	case p.PID == os.Getpid():
		return fmt.Sprintf("this qcowfs (pid %d)", p.PID)
	case p.FSType == "fuse.qcowfs" || strings.HasPrefix(p.Command, "qcowfs") || p.Command == "mount.fuse.qcowfs":
		if p.Mount != "" {
			return fmt.Sprintf("another qcowfs (pid %d, mounted at %s)", p.PID, p.Mount)
		}
		return fmt.Sprintf("another qcowfs (pid %d)", p.PID)
	case p.Command != "":
		return fmt.Sprintf("%s (pid %d)", p.Command, p.PID)
	}
	return fmt.Sprintf("pid %d", p.PID)
}

// LockHolder returns a process that holds a lock covering byte off of f's
// file through a descriptor other than f (a process of another PID
// namespace or one it may not look into is not found).
func LockHolder(f *os.File, off int64) (Process, bool) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return Process{}, false
	}
	self, own := os.Getpid(), strconv.Itoa(int(f.Fd()))
	key := lockKey{uint64(st.Dev), st.Ino, off}
	// The descriptor found last time, if it still holds the lock: an
	// image a qemu writes is tried again at every listing, and a walk
	// of every descriptor of the machine each time would make a
	// listing of many running VMs' images slow.
	if at, ok := found.get(key); ok && !(at.pid == self && at.fd == own) {
		var fst unix.Stat_t
		if unix.Stat(fmt.Sprintf("/proc/%d/fd/%s", at.pid, at.fd), &fst) == nil &&
			fst.Dev == st.Dev && fst.Ino == st.Ino && holds(fdinfo(at.pid, at.fd), off) {
			return describe(at.pid), true
		}
	}
	var at fdRef
	walk(func(p int, fd string, fst *unix.Stat_t) bool {
		if fst.Dev != st.Dev || fst.Ino != st.Ino || p == self && fd == own {
			return false
		}
		if holds(fdinfo(p, fd), off) {
			at = fdRef{p, fd}
			return true
		}
		return false
	})
	if at.pid == 0 {
		return Process{}, false
	}
	found.put(key, at)
	return describe(at.pid), true
}

// lockKey is a byte of a file: device, inode, offset.
type lockKey struct {
	dev, ino uint64
	off      int64
}

// fdRef is a descriptor of a process.
type fdRef struct {
	pid int
	fd  string
}

// found remembers where LockHolder last found each lock's holder: hints,
// checked before use, at most maxFound of them.
var found = &foundHolders{m: map[lockKey]fdRef{}}

const maxFound = 1024

type foundHolders struct {
	mu sync.Mutex
	m  map[lockKey]fdRef
}

func (h *foundHolders) get(k lockKey) (fdRef, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	r, ok := h.m[k]
	return r, ok
}

func (h *foundHolders) put(k lockKey, r fdRef) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.m) >= maxFound {
		clear(h.m)
	}
	h.m[k] = r
}

// FUSEServer returns the process that serves the FUSE connection conn
// (the minor number of the mount's device: mountinfo's "0:conn").
func FUSEServer(conn int) (Process, bool) {
	pid := 0
	walk(func(p int, fd string, fst *unix.Stat_t) bool {
		if isFUSE(fst) && fuseConnection(fdinfo(p, fd)) == conn {
			pid = p
			return true
		}
		return false
	})
	if pid == 0 {
		return Process{}, false
	}
	return describe(pid), true
}

// walk calls fn with every descriptor of every process it may look at,
// and the stat of the file it refers to, until fn returns true.
func walk(fn func(pid int, fd string, st *unix.Stat_t) bool) {
	procs, err := os.ReadDir("/proc")
	if err != nil {
		return
	}
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		dir := filepath.Join("/proc", p.Name(), "fd")
		fds, err := os.ReadDir(dir)
		if err != nil {
			continue // gone, or not ours to look at
		}
		for _, fd := range fds {
			st, err := statCached(filepath.Join(dir, fd.Name()))
			if err != nil {
				continue
			}
			if fn(pid, fd.Name(), &st) {
				return
			}
		}
	}
}

// statCached stats a descriptor's file (/proc/PID/fd/N) as the kernel
// has it cached (AT_STATX_DONT_SYNC), so that a descriptor on a FUSE
// mount sends its daemon no request: a daemon that does not answer (or
// this very process, serving its own mount) would hang the walk. The
// fields used, device, inode and type, never change for a file.
func statCached(path string) (unix.Stat_t, error) {
	var x unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, path, unix.AT_STATX_DONT_SYNC, unix.STATX_TYPE|unix.STATX_INO, &x); err != nil {
		return unix.Stat_t{}, err
	}
	return unix.Stat_t{
		Dev:  unix.Mkdev(x.Dev_major, x.Dev_minor),
		Ino:  x.Ino,
		Mode: uint32(x.Mode),
		Rdev: unix.Mkdev(x.Rdev_major, x.Rdev_minor),
	}, nil
}

func fdinfo(pid int, fd string) []byte {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/fdinfo/%s", pid, fd))
	return b
}

// holds reports whether an fdinfo lists a lock (held, not waited for)
// covering byte off. Its lines read, as in /proc/locks:
//
//	lock:	1: OFDLCK  ADVISORY  READ  -1 fe:00:9984379 100 101
//	lock:	2: POSIX  ADVISORY  WRITE 4242 fe:00:9984379 0 EOF
func holds(info []byte, off int64) bool {
	sc := bufio.NewScanner(bytes.NewReader(info))
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), "lock:")
		if !ok || strings.Contains(rest, "->") {
			continue
		}
		f := strings.Fields(rest)
		if len(f) < 8 {
			continue
		}
		start, err := strconv.ParseInt(f[6], 10, 64)
		if err != nil || off < start {
			continue
		}
		if f[7] == "EOF" {
			return true
		}
		if end, err := strconv.ParseInt(f[7], 10, 64); err == nil && off <= end {
			return true
		}
	}
	return false
}

// isFUSE reports whether st is /dev/fuse (character device 10:229).
func isFUSE(st *unix.Stat_t) bool {
	return st.Mode&unix.S_IFMT == unix.S_IFCHR && unix.Major(st.Rdev) == 10 && unix.Minor(st.Rdev) == 229
}

// fuseConnection is the "fuse_connection:" of a /dev/fuse fdinfo, or -1.
func fuseConnection(info []byte) int {
	for _, line := range strings.Split(string(info), "\n") {
		if v, ok := strings.CutPrefix(line, "fuse_connection:"); ok {
			if n, err := strconv.Atoi(strings.TrimSpace(v)); err == nil {
				return n
			}
		}
	}
	return -1
}

// describe reads what a message needs of process pid: its program, and
// the FUSE mount it serves, if any.
func describe(pid int) Process {
	p := Process{PID: pid}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); err == nil {
		arg0, _, _ := bytes.Cut(b, []byte{0})
		p.Command = filepath.Base(string(arg0))
	}
	if p.Command == "" || p.Command == "." {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
		p.Command = strings.TrimSpace(string(b))
	}
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	fds, _ := os.ReadDir(dir)
	for _, fd := range fds {
		var st unix.Stat_t
		if unix.Stat(filepath.Join(dir, fd.Name()), &st) != nil || !isFUSE(&st) {
			continue
		}
		conn := fuseConnection(fdinfo(pid, fd.Name()))
		if conn < 0 {
			continue
		}
		if m := fuseMount(conn); m != nil {
			p.Mount, p.FSType = m.Point, m.FSType
			break
		}
	}
	return p
}

// fuseMount is the mount of FUSE connection conn that this process sees
// (the one of the file system's root, if it is bound elsewhere too).
func fuseMount(conn int) *mountinfo.Mount {
	mounts, err := mountinfo.Read()
	if err != nil {
		return nil
	}
	var found *mountinfo.Mount
	for i, m := range mounts {
		if m.MajMin == "0:"+strconv.Itoa(conn) && strings.HasPrefix(m.FSType, "fuse") {
			if m.Root == "/" {
				return &mounts[i]
			}
			if found == nil {
				found = &mounts[i]
			}
		}
	}
	return found
}
