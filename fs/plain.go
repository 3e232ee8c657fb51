package fs

import (
	"context"
	"os"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// plainNode is a regular file that is not a qcow2 image, shown unchanged
// and read-only.
type plainNode struct {
	gofs.Inode
	noXattrs
	m   *mount
	rel string
	key fileKey
}

var (
	_ = (gofs.NodeOpener)((*plainNode)(nil))
	_ = (gofs.NodeGetattrer)((*plainNode)(nil))
)

// Open opens the source file through the source root; it must still be the
// file the node was looked up as.
func (n *plainNode) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	if flags&(syscall.O_WRONLY|syscall.O_RDWR|syscall.O_TRUNC) != 0 {
		return nil, 0, syscall.EROFS
	}
	f, err := n.m.src.openPlain(n.rel)
	if err != nil {
		return nil, 0, gofs.ToErrno(err)
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil || keyOf(&st) != n.key {
		f.Close()
		return nil, 0, syscall.ESTALE
	}
	return &plainHandle{f: f}, 0, 0
}

func (n *plainNode) Getattr(ctx context.Context, f gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	st, err := n.m.src.stat(n.rel)
	if err != nil {
		return gofs.ToErrno(err)
	}
	n.m.fillAttr(&out.Attr, &shown{e: &entry{kind: kindPlain, st: st, key: keyOf(&st)}})
	return 0
}

// plainHandle is one open of a plain file.
type plainHandle struct{ f *os.File }

var (
	_ = (gofs.FileReader)((*plainHandle)(nil))
	_ = (gofs.FileReleaser)((*plainHandle)(nil))
	_ = (gofs.FilePassthroughFder)((*plainHandle)(nil))
)

// PassthroughFd hands the source file to the kernel (FUSE passthrough,
// Linux 6.9 and later, root only): its reads then go straight to the file,
// never through the daemon, and cost what reading the file costs. Where
// the kernel or the privileges do not allow it, go-fuse falls back to
// Read (and stops asking).
func (h *plainHandle) PassthroughFd() (int, bool) { return int(h.f.Fd()), true }

// Read splices straight from the source file.
func (h *plainHandle) Read(ctx context.Context, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	return fuse.ReadResultFd(h.f.Fd(), off, len(dest)), 0
}

func (h *plainHandle) Release(ctx context.Context) syscall.Errno {
	h.f.Close()
	return 0
}
