package fs

import (
	"context"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// imageNode is a qcow2 image, one of its internal snapshots, or a
// partition of either, shown as a raw file. It stands for one generation of
// the image file (identity.go); the image itself is opened while the node
// has open handles (registry.go).
type imageNode struct {
	gofs.Inode
	m     *mount
	x     *shown // the disk as listed
	part  int    // a partition number; 0 for the whole disk
	start int64  // where the file starts in the disk: a partition's offset
	size  int64
}

var (
	_ = (gofs.NodeOpener)((*imageNode)(nil))
	_ = (gofs.NodeGetattrer)((*imageNode)(nil))
)

// disk is the disk (or partition) the node shows.
func (n *imageNode) disk() diskID {
	d := n.x.disk()
	d.part = n.part
	return d
}

// Open opens the image for reading, taking qemu's reader locks while any
// handle has it open. The content cannot change while it is served, so the
// kernel may keep its page cache across opens: a change by someone else
// makes a new node (identity.go).
func (n *imageNode) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	if flags&(syscall.O_WRONLY|syscall.O_RDWR|syscall.O_TRUNC) != 0 {
		return nil, 0, syscall.EROFS
	}
	oi, err := n.m.openHandle(n.disk(), n.x.e.rel)
	if err != nil {
		if err != syscall.ESTALE {
			n.m.log.Warn("cannot open image", "image", n.m.src.abs(n.x.e.rel), "reason", err.Error())
		}
		return nil, 0, errnoOf(err)
	}
	return &imageHandle{n: n, oi: oi}, fuse.FOPEN_KEEP_CACHE, 0
}

// Getattr reports the image file's attributes with the virtual size.
func (n *imageNode) Getattr(ctx context.Context, f gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	x := *n.x
	x.part, x.size = n.part, n.size
	if n.m.fillAttr(&out.Attr, &x) {
		out.SetTimeout(imageAttrTimeout)
	}
	return 0
}

// imageHandle is one open of an image node: reads and lseek are answered
// here, against the image the handle holds.
type imageHandle struct {
	n  *imageNode
	oi *openImage
}

var _ = (gofs.FileReader)((*imageHandle)(nil))

// Read serves a read from the image; requests run in parallel.
func (h *imageHandle) Read(ctx context.Context, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	n := h.n
	return n.m.read(h.oi, dest, n.start+off, n.start+n.size)
}

var _ = (gofs.FileReleaser)((*imageHandle)(nil))

// Release gives the handle's use of the image back.
func (h *imageHandle) Release(ctx context.Context) syscall.Errno {
	h.n.m.closeHandle(h.oi)
	return 0
}
