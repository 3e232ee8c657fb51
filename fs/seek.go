package fs

import (
	"context"
	"errors"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
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
// when the kernel interrupts the request (the caller was killed).
func (h *imageHandle) Lseek(ctx context.Context, off uint64, whence uint32) (uint64, syscall.Errno) {
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
		pos, err = img.NextDataContext(ctx, at)
		if errors.Is(err, qcow2.ErrNoData) || (err == nil && pos >= end) {
			return 0, syscall.ENXIO
		}
	case unix.SEEK_HOLE:
		pos, err = img.NextHoleContext(ctx, at)
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
