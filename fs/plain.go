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
	m    *mount
	path string
	v    version
}

var (
	_ = (gofs.NodeOpener)((*plainNode)(nil))
	_ = (gofs.NodeReader)((*plainNode)(nil))
	_ = (gofs.NodeReleaser)((*plainNode)(nil))
	_ = (gofs.NodeGetattrer)((*plainNode)(nil))
)

type plainHandle struct{ f *os.File }

func (n *plainNode) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	if flags&(syscall.O_WRONLY|syscall.O_RDWR|syscall.O_TRUNC) != 0 {
		return nil, 0, syscall.EROFS
	}
	f, err := os.Open(n.path)
	if err != nil {
		return nil, 0, gofs.ToErrno(err)
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil || st.Ino != n.v.ino || st.Dev != n.v.dev {
		f.Close()
		return nil, 0, syscall.ESTALE
	}
	return &plainHandle{f: f}, 0, 0
}

// Read splices straight from the source file.
func (n *plainNode) Read(ctx context.Context, f gofs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	return fuse.ReadResultFd(f.(*plainHandle).f.Fd(), off, len(dest)), 0
}

func (n *plainNode) Release(ctx context.Context, f gofs.FileHandle) syscall.Errno {
	f.(*plainHandle).f.Close()
	return 0
}

func (n *plainNode) Getattr(ctx context.Context, f gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	var st syscall.Stat_t
	if err := syscall.Stat(n.path, &st); err != nil {
		return gofs.ToErrno(err)
	}
	n.m.fillAttr(&out.Attr, &entry{kind: kindPlain, v: versionOf(&st), st: st, size: st.Size})
	return 0
}
