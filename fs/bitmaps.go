package fs

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"maps"
	"slices"
	"strings"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/qcow2"
)

// Changed-blocks views: what a persistent dirty bitmap says changed, as a
// file a backup can copy.
//
// An image (its current state: snapshots have no bitmaps) with persistent
// bitmaps gets a read-only folder beside its file, STEM.raw.bitmaps, with
// one file per bitmap, NAME.raw (the bitmap's name escaped as snapshot
// names are, names.go). A view is as large as the disk. Where the bitmap
// says the disk changed (a dirty granule) its bytes are the disk's;
// elsewhere it is a hole, which means "unchanged since the bitmap was
// cleared", not zeros. SEEK_DATA and SEEK_HOLE answer from the bitmap, and
// st_blocks is the dirty bytes, so that cp, which only looks for holes when
// st_blocks says the file has some, copies just what changed.
//
// The bitmap is qcow2's (Image.BitmapView): read from the image file when
// the view is opened, or, for a bitmap a writer of this mount keeps, live.
// A bitmap in use by no writer of ours (its writer did not close it
// cleanly) is inconsistent: it gets no view, with a log line, as qemu-nbd
// -B refuses it. Bytes are read through the image, zero-copy where a read
// lies in one dirty run. In overlay mode the bitmaps are the original
// image file's, and so are the bytes a view shows: the overlay's writes
// are in no bitmap.
//
// Views are opened FOPEN_DIRECT_IO, without the kernel's page cache. In a
// writable mount a view is live: every write of the disk may change its
// bytes and turn holes into data, so cached pages would go stale, and
// invalidating them would cost a notification per view on every write of
// the disk, for a file that is read once per backup. Without the cache
// each read reaches qcowfs exactly as the reader made it, with no
// readahead into the holes the reader skips: a backup reads the dirty
// ranges and nothing else (the same in a read-only mount, for one
// behaviour). For the same reason a live view's attributes are not
// cached. But with the writeback cache the kernel keeps the size a regular
// file had when its inode was made, whatever we answer (fuse_get_cache_mask
// in the kernel's fs/fuse), as it does for the disk's own file
// (writeback.go): so a view's generation mixes in the disk's size, and when
// the disk grows through the mount its views' names are dropped
// (grewViews), so that the next lookup makes a node of the new size.
// Descriptors open on the old node keep the old size.

const bitmapsSuffix = ".bitmaps"

// bitmapsName is the folder name for the bitmap views of the disk shown
// as name.
func bitmapsName(name string) string { return name + bitmapsSuffix }

// bitmapFacts is a bitmap that gets a view.
type bitmapFacts struct {
	name string // the bitmap's name
	file string // its view's file name
}

// readBitmaps lists the bitmaps of img (the image file at path) that get
// a view, and, by name, why the others do not. They are logged in one
// line (a directory may hold 65,535), unless the previous validation's
// (old) were the same.
//
// A bitmap in use is this mount's own if img is written (an image with a
// bitmap in use at open opens read-only: Image.ReadOnlyReason), and its
// view is live; else it is inconsistent, and BitmapView refuses it, as
// qemu-nbd -B does.
func (m *mount) readBitmaps(img *qcow2.Image, path string, old map[string]string) ([]bitmapFacts, map[string]string) {
	var shown []bitmapFacts
	hidden := map[string]string{}
	var first string
	for _, b := range img.Bitmaps() {
		file := escapeName(b.Name) + ".raw"
		why := ""
		switch {
		case slices.Contains(b.Flags, "in-use") && !img.Writable():
			why = "the bitmap is in use: a program writing the image did not close it cleanly, so it may miss writes"
		case len(file) > nameMax:
			why = "its escaped name is longer than 255 bytes"
		default:
			shown = append(shown, bitmapFacts{name: b.Name, file: file})
			continue
		}
		if len(hidden) == 0 {
			first = b.Name
		}
		hidden[b.Name] = why
	}
	if len(hidden) > 0 && !maps.Equal(hidden, old) {
		m.log.Warn("bitmap view not shown", "image", path, "bitmap", first, "reason", hidden[first], "not shown", len(hidden))
	}
	return shown, hidden
}

// layoutBitmaps is what a bitmaps folder shows: its files' names.
func layoutBitmaps(bs []bitmapFacts) string {
	var b strings.Builder
	for _, f := range bs {
		b.WriteString(f.file)
		b.WriteByte('/')
	}
	return b.String()
}

// bitmapsNode is the folder of one disk's bitmap views.
type bitmapsNode struct {
	gofs.Inode
	noXattrs
	m    *mount
	disk *shown // the folder as listed: its entry (facts.bitmaps)
}

var (
	_ = (gofs.NodeLookuper)((*bitmapsNode)(nil))
	_ = (gofs.NodeReaddirer)((*bitmapsNode)(nil))
	_ = (gofs.NodeGetattrer)((*bitmapsNode)(nil))
)

func (n *bitmapsNode) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	for _, b := range n.disk.e.facts.bitmaps {
		if b.file != name {
			continue
		}
		whole := *n.disk
		whole.part = 0
		node := &bitmapNode{m: n.m, disk: &whole, bitmap: b.name}
		v, done, err := node.view(nil)
		if err != nil {
			return nil, node.failed(err)
		}
		node.fillAttr(&out.Attr, v)
		size := v.Size()
		done()
		stable := gofs.StableAttr{Mode: syscall.S_IFREG, Ino: node.inode(), Gen: n.m.nodeGen(n.disk) ^ uint64(size)*0x9e3779b97f4a7c15 | 1}
		out.SetAttrTimeout(node.attrTimeout())
		return n.NewInode(ctx, node, stable), 0
	}
	return nil, syscall.ENOENT
}

func (n *bitmapsNode) Readdir(ctx context.Context) (gofs.DirStream, syscall.Errno) {
	var list []fuse.DirEntry
	for _, b := range n.disk.e.facts.bitmaps {
		node := &bitmapNode{disk: n.disk, bitmap: b.name}
		list = append(list, fuse.DirEntry{Name: b.file, Mode: syscall.S_IFREG, Ino: node.inode()})
	}
	return gofs.NewListDirStream(list), 0
}

func (n *bitmapsNode) Getattr(ctx context.Context, f gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	n.m.fillAttr(&out.Attr, n.disk)
	return 0
}

// grewViews drops the names of the views of n's disk, which grew (see
// above), before the request that grew it is answered.
func (n *imageNode) grewViews() {
	dir, name := n.shownIn()
	if n.part != 0 || dir == nil {
		return
	}
	folder := dir.GetChild(bitmapsName(name))
	if folder == nil {
		return
	}
	for file := range folder.Children() {
		folder.RmChild(file)
		folder.NotifyEntry(file)
	}
}

// bitmapNode is one bitmap's view.
type bitmapNode struct {
	gofs.Inode
	noXattrs
	m      *mount
	disk   *shown // the disk, as listed
	bitmap string
}

var (
	_ = (gofs.NodeOpener)((*bitmapNode)(nil))
	_ = (gofs.NodeGetattrer)((*bitmapNode)(nil))
)

// inode is the view's inode number: a hash of the image file and the
// bitmap's name, with the top bit set (as diskID.inode's).
func (n *bitmapNode) inode() uint64 {
	h := fnv.New64a()
	fmt.Fprintf(h, "%d/%d/bitmap/%s", n.disk.e.key.dev, n.disk.e.key.ino, n.bitmap)
	return h.Sum64() | 1<<63
}

// attrTimeout is how long the kernel may keep the view's attributes: as
// long as an image's in a read-only mount, and no time (a nanosecond; zero
// would mean the mount's default) in a writable one, where the view is
// live.
func (n *bitmapNode) attrTimeout() time.Duration {
	if n.m.cfg.Writable {
		return time.Nanosecond
	}
	return imageAttrTimeout
}

// view returns the bitmap's view: h's, or one made for the call (done
// gives it back).
func (n *bitmapNode) view(h *bitmapHandle) (v *qcow2.BitmapView, done func(), err error) {
	if h != nil {
		return h.v, func() {}, nil
	}
	oi, err := n.m.acquire(n.disk.disk(), n.disk.e.rel)
	if err != nil {
		return nil, nil, err
	}
	if v, err = oi.orig.BitmapView(n.bitmap); err != nil {
		n.m.release(oi)
		return nil, nil, err
	}
	return v, func() { v.Close(); n.m.release(oi) }, nil
}

// failed logs why the view could not be made, and maps the error.
func (n *bitmapNode) failed(err error) syscall.Errno {
	if err == syscall.ESTALE {
		return syscall.ESTALE
	}
	n.m.log.Warn("cannot open bitmap view", "image", n.m.src.abs(n.disk.e.rel), "bitmap", n.bitmap, "reason", err.Error())
	if errors.Is(err, qcow2.ErrNoBitmap) {
		return syscall.ENOENT
	}
	return errnoOf(err)
}

// fillAttr sets the view's attributes: the image file's owner and times,
// read-only, the disk's size, and the dirty bytes as its blocks.
func (n *bitmapNode) fillAttr(a *fuse.Attr, v *qcow2.BitmapView) {
	a.FromStat(&n.disk.e.st)
	a.Ino = n.inode()
	a.Mode = n.disk.e.st.Mode&0o444 | syscall.S_IFREG
	a.Nlink = 1
	a.Blksize = 1 << 16
	size := v.Size()
	var dirty int64
	for off := v.NextDirty(0); off < size; off = v.NextDirty(off) {
		end := v.NextClean(off)
		dirty += end - off
		off = end
	}
	a.Size = uint64(size)
	a.Blocks = (uint64(dirty) + 511) / 512
}

func (n *bitmapNode) Getattr(ctx context.Context, f gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	h, _ := f.(*bitmapHandle)
	v, done, err := n.view(h)
	if err != nil {
		return n.failed(err)
	}
	defer done()
	n.fillAttr(&out.Attr, v)
	out.SetTimeout(n.attrTimeout())
	return 0
}

// Open opens the image for reading, with a reader's locks as the disk's
// own file takes them, and the bitmap's view (see above for the flags).
func (n *bitmapNode) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	if flags&(syscall.O_WRONLY|syscall.O_RDWR|syscall.O_TRUNC) != 0 {
		return nil, 0, syscall.EROFS
	}
	oi, err := n.m.openHandle(n.disk.disk(), n.disk.e.rel, false)
	if err != nil {
		return nil, 0, n.failed(err)
	}
	v, err := oi.orig.BitmapView(n.bitmap)
	if err != nil {
		n.m.closeHandle(oi, false)
		return nil, 0, n.failed(err)
	}
	return &bitmapHandle{n: n, oi: oi, v: v}, fuse.FOPEN_DIRECT_IO, 0
}

// bitmapHandle is one open of a view.
type bitmapHandle struct {
	n  *bitmapNode
	oi *openImage
	v  *qcow2.BitmapView
}

var (
	_ = (gofs.FileReader)((*bitmapHandle)(nil))
	_ = (gofs.FileLseeker)((*bitmapHandle)(nil))
	_ = (gofs.FileReleaser)((*bitmapHandle)(nil))
)

// Read answers from the image where the bitmap is dirty, with zeros
// elsewhere: a read inside one dirty run as the disk's file is read
// (zero-copy where it can be), one with no dirty byte with zeros, a mixed
// one copied. Every reply counts as a read of the image (qcowfs status).
func (h *bitmapHandle) Read(ctx context.Context, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	v, img, m := h.v, h.oi.orig, h.n.m
	size := v.Size()
	if off >= size {
		return fuse.ReadResultData(nil), 0
	}
	end := min(off+int64(len(dest)), size)
	n := end - off
	dirty := v.NextDirty(off)
	switch {
	case dirty >= end && n <= int64(len(zeros)):
		h.oi.countRead(n)
		return fuse.ReadResultData(zeros[:n]), 0
	case dirty == off && v.NextClean(off) >= end:
		return m.readImage(h.oi, img, dest, off, end)
	}
	buf := dest[:n]
	pin := img.PinRange(off, n)
	defer pin.Release()
	for pos := off; pos < end; {
		d := min(v.NextDirty(pos), end)
		clear(buf[pos-off : d-off])
		if d == end {
			break
		}
		c := min(v.NextClean(d), end)
		if _, err := img.ReadAt(buf[d-off:c-off], d); err != nil && err != io.EOF {
			return nil, m.readFailed(h.oi, d, err)
		}
		pos = c
	}
	h.oi.countRead(n)
	return fuse.ReadResultData(buf), 0
}

// Lseek answers SEEK_DATA and SEEK_HOLE from the bitmap, with lseek(2)'s
// semantics (as imageHandle.Lseek): data is a dirty granule.
func (h *bitmapHandle) Lseek(ctx context.Context, off uint64, whence uint32) (uint64, syscall.Errno) {
	size := h.v.Size()
	if int64(off) < 0 || int64(off) >= size {
		if whence == unix.SEEK_DATA || whence == unix.SEEK_HOLE {
			return 0, syscall.ENXIO
		}
		return 0, syscall.EINVAL
	}
	switch whence {
	case unix.SEEK_DATA:
		pos := h.v.NextDirty(int64(off))
		if pos >= size {
			return 0, syscall.ENXIO
		}
		return uint64(pos), 0
	case unix.SEEK_HOLE:
		return uint64(h.v.NextClean(int64(off))), 0
	}
	return 0, syscall.EINVAL
}

func (h *bitmapHandle) Release(ctx context.Context) syscall.Errno {
	h.v.Close()
	h.n.m.closeHandle(h.oi, false)
	return 0
}
