package fs

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/qcow2"
)

var _ = (gofs.FileLseeker)((*imageHandle)(nil))

// Lseek answers SEEK_DATA and SEEK_HOLE from the image's block status, with
// the semantics of a local file (lseek(2)): SEEK_DATA returns the first
// data offset at or after off, ENXIO if there is none or off is at or past
// the end; SEEK_HOLE returns the first hole at or after off, the end of the
// file counting as one, ENXIO if off is at or past the end. The kernel
// handles SEEK_SET, SEEK_CUR and SEEK_END itself and only sends these two.
// The walk behind an answer is bounded (qcow2's SeekWork: where it runs
// out the answer is conservative, data where unsure) and ends with EINTR
// when the kernel interrupts the request of a caller being killed
// (killable).
func (h *imageHandle) Lseek(ctx context.Context, off uint64, whence uint32) (uint64, syscall.Errno) {
	ctx, stop := killable(ctx)
	defer stop()
	n := h.n
	img := h.oi.image()
	// The file is [n.start, end) of the disk.
	end := min(n.start+n.fileSize(h.oi), img.Size())
	if int64(off) < 0 || n.start+int64(off) >= end {
		if whence == unix.SEEK_DATA || whence == unix.SEEK_HOLE {
			return 0, syscall.ENXIO
		}
		return 0, syscall.EINVAL
	}
	at := n.start + int64(off)
	var pos int64
	var err error
	switch whence {
	case unix.SEEK_DATA:
		pos, err = img.NextData(ctx, at)
		if errors.Is(err, qcow2.ErrNoData) || (err == nil && pos >= end) {
			return 0, syscall.ENXIO
		}
	case unix.SEEK_HOLE:
		pos, err = img.NextHole(ctx, at)
		pos = min(pos, end)
	default:
		return 0, syscall.EINVAL
	}
	if errors.Is(err, context.Canceled) {
		return 0, syscall.EINTR
	}
	if err != nil {
		return 0, n.m.readFailed(h.oi, at, err)
	}
	return uint64(pos - n.start), 0
}

// killable is the request's context, ended only when the kernel interrupts
// the request and its caller is being killed. The kernel interrupts a
// request on any signal its caller takes: a program with a handler for
// SIGCHLD or SIGWINCH, and every Go program (the runtime preempts with
// SIGURG), would otherwise see EINTR from an lseek or a read of a regular
// file, which no program expects. A killed caller's walk stops at once;
// any other goes on to its answer (bounded by SeekWork and, remote, by
// --remote-timeout). stop releases the context.
func killable(ctx context.Context) (context.Context, func()) {
	caller, ok := fuse.FromContext(ctx)
	if !ok || ctx.Done() == nil {
		return ctx, func() {}
	}
	pid := caller.Pid
	out, cancel := context.WithCancel(context.WithoutCancel(ctx))
	unhook := context.AfterFunc(ctx, func() {
		if dying(pid) {
			cancel()
		}
	})
	return out, func() {
		unhook()
		cancel()
	}
}

// dying reports whether the thread tid has a fatal signal pending: the
// kernel adds SIGKILL to the pending set of every thread of a process a
// fatal signal kills (its own pending set, SigPnd, or the shared one,
// ShdPnd, in /proc/TID/status). A thread that is gone, or that the
// daemon cannot see (pid 0: a caller outside the daemon's pid namespace),
// counts as dying: its request ends on the interrupt, as before.
func dying(tid uint32) bool {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", tid))
	if err != nil {
		return true
	}
	defer f.Close()
	const sigkill = 1 << (unix.SIGKILL - 1)
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		name, val, ok := bytes.Cut(sc.Bytes(), []byte(":"))
		if !ok || (string(name) != "SigPnd" && string(name) != "ShdPnd") {
			continue
		}
		mask, err := strconv.ParseUint(string(bytes.TrimSpace(val)), 16, 64)
		if err == nil && mask&sigkill != 0 {
			return true
		}
	}
	return false
}
