package fs

import (
	"context"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// imageNode is a qcow2 image, one of its internal snapshots, or a
// partition of either, shown as a raw file. It stands for one version of the image file; the image
// itself is opened while the node has open handles (see mount.acquire).
type imageNode struct {
	gofs.Inode
	m     *mount
	path  string
	d     diskID // the image file version, snapshot and partition
	start int64  // where the file starts in the disk: a partition's offset
	size  int64
	used  int64 // estimate of the data bytes; see usage.go
}

var (
	_ = (gofs.NodeOpener)((*imageNode)(nil))
	_ = (gofs.NodeReader)((*imageNode)(nil))
	_ = (gofs.NodeReleaser)((*imageNode)(nil))
	_ = (gofs.NodeGetattrer)((*imageNode)(nil))
)

// imageHandle is one open of an image node.
type imageHandle struct {
	oi *openImage
}

// Open opens the image for reading. The content cannot change while it is
// served, so the kernel may keep its page cache across opens.
func (n *imageNode) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	if flags&(syscall.O_WRONLY|syscall.O_RDWR|syscall.O_TRUNC) != 0 {
		return nil, 0, syscall.EROFS
	}
	oi, err := n.m.acquire(n.path, n.d)
	if err != nil {
		n.m.log.Error("cannot open image", "image", n.path, "err", err)
		return nil, 0, errnoOf(err)
	}
	return &imageHandle{oi: oi}, fuse.FOPEN_KEEP_CACHE, 0
}

// Read serves a read from the image; requests run in parallel.
func (n *imageNode) Read(ctx context.Context, f gofs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	return n.m.read(f.(*imageHandle).oi, dest, n.start+off, n.start+n.size)
}

func (n *imageNode) Release(ctx context.Context, f gofs.FileHandle) syscall.Errno {
	n.m.release(n.d, f.(*imageHandle).oi)
	return 0
}

// Getattr reports the image file's attributes with the virtual size.
func (n *imageNode) Getattr(ctx context.Context, f gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	var st syscall.Stat_t
	if err := syscall.Stat(n.path, &st); err != nil || versionOf(&st) != n.d.v {
		// The file changed or went away; this node still describes
		// the version it was looked up as.
		st = syscall.Stat_t{}
	}
	e := &entry{kind: kindImage, v: n.d.v, snap: n.d.snap, part: n.d.part, size: n.size, used: n.used, st: st}
	if st.Ino == 0 {
		e.st.Mode = syscall.S_IFREG | 0o444
		e.st.Ino = n.d.v.ino
	}
	if n.m.fillAttr(&out.Attr, e) {
		out.SetTimeout(imageAttrTimeout)
	}
	return 0
}
