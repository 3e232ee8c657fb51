package fs

import (
	"context"
	"sync/atomic"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// imageNode is a qcow2 image, one of its internal snapshots, or a
// partition of either, shown as a raw file. It stands for one generation of
// the image file (identity.go); the image itself is opened while the node
// has open handles (registry.go).
type imageNode struct {
	gofs.Inode
	noXattrs
	m     *mount
	x     *shown // the disk as listed
	part  int    // a partition number; 0 for the whole disk
	start int64  // where the file starts in the disk: a partition's offset
	size  int64  // a partition's size; for a whole disk, its size when listed

	replaced atomic.Bool // a write past the end replaced it (writeback.go)

	// vw is the node as a view of its disk's bytes (views.go), for a
	// disk that may be written; else nil.
	vw *viewMember
}

var (
	_ = (gofs.NodeOpener)((*imageNode)(nil))
	_ = (gofs.NodeGetattrer)((*imageNode)(nil))
	_ = (gofs.NodeSetattrer)((*imageNode)(nil))
	_ = (gofs.NodeOnAdder)((*imageNode)(nil))
)

// OnAdd makes a new node of a writable mount's disk (not a snapshot) a
// view of the disk's bytes. (go-fuse calls it only for a node it takes
// into the tree, not for one it drops for a node it already knew.)
func (n *imageNode) OnAdd(ctx context.Context) {
	if n.m.cfg.Writable && n.x.snap == 0 {
		n.vw = n.m.views.join(n.disk().base(), n)
	}
}

// overlaps reports whether the node's file shows any of the disk's bytes
// [off, off+size): a partition its range, a whole disk all of them.
func (n *imageNode) overlaps(off, size int64) bool {
	if n.part == 0 {
		return true
	}
	return (size < 0 || off < n.start+n.size) && off+size > n.start
}

// drop has the kernel write back and drop the node's pages that hold the
// disk's bytes [off, off+size) (all of them if size < 0). A node the kernel
// has forgotten has none (ENOENT).
func (n *imageNode) drop(off, size int64) {
	if size < 0 {
		n.NotifyContent(0, 0)
	} else if o, l := n.fileRange(off, size); l > 0 {
		n.NotifyContent(o, l)
	}
}

// fileRange is where the disk's bytes [off, off+size) lie in the node's
// file: l bytes at o, none if l is 0.
func (n *imageNode) fileRange(off, size int64) (o, l int64) {
	lo, hi := off, off+size
	if n.part != 0 {
		lo, hi = max(lo, n.start), min(hi, n.start+n.size)
	}
	if lo >= hi {
		return 0, 0
	}
	return lo - n.start, hi - lo
}

// directViews says whether a handle of one of a disk's views may bypass
// the page cache (views.go): with the writeback cache, only on a kernel
// that writes the dirty pages of a range back before a direct write of it.
func (m *mount) directViews() bool {
	return !m.cfg.WritebackCache || m.directFlushes.Load()
}

// disk is the disk (or partition) the node shows.
func (n *imageNode) disk() diskID {
	d := n.x.disk()
	d.part = n.part
	return d
}

// writable reports whether the node's file may be opened for writing: a
// writable mount, the image itself or a partition of it (not a snapshot),
// an image that can be written, and not the backing file of another.
func (n *imageNode) writable() bool { return n.m.writableDisk(n.x) }

// Open opens the image, taking qemu's reader locks while any handle has it
// open, and a writer's while a handle opened for writing has. The content
// cannot change under the kernel's page cache but through this mount, so
// the kernel may keep the cache across opens: a change by someone else
// makes a new node (identity.go).
func (n *imageNode) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	write := flags&(syscall.O_WRONLY|syscall.O_RDWR) != 0
	if write && !n.writable() {
		return nil, 0, syscall.EROFS
	}
	if flags&syscall.O_TRUNC != 0 {
		// Truncating to zero would shrink the disk, which qcow2 (and
		// a disk) cannot do; dd conv=notrunc writes without it.
		n.m.log.Warn("open with O_TRUNC refused: a disk cannot shrink (use dd conv=notrunc, or cp --sparse=always onto a fresh file)", "image", n.m.src.abs(n.x.e.rel))
		return nil, 0, syscall.EPERM
	}
	oi, err := n.m.openHandle(n.disk(), n.x.e.rel, write)
	if err != nil {
		if err != syscall.ESTALE {
			n.m.log.Warn("cannot open image", "image", n.m.src.abs(n.x.e.rel), "reason", err.Error())
		}
		return nil, 0, errnoOf(err)
	}
	h := &imageHandle{n: n, oi: oi, write: write}
	h.cached = n.vw.open(write, n.m.directViews())
	// Pages written back through another view are dropped from this
	// one's before it is read.
	n.vw.barrier()
	if !write && h.cached && flags&syscall.O_DIRECT == 0 {
		h.holes = newHoleWatch() // (O_DIRECT reads bypass the page cache)
	}
	return h, n.m.openFlags(write, flags, h.cached), 0
}

// openFlags are the open reply's flags. A handle of a disk that another
// view of its bytes has open (views.go) may have to do without the page
// cache (cached false). A handle opened for writing with
// O_DIRECT bypasses the kernel's page cache anyway; FOPEN_DIRECT_IO with
// FOPEN_PARALLEL_DIRECT_WRITES lets the kernel send its writes in
// parallel. (On the cached path the kernel holds the file's lock across
// each O_DIRECT write, so four writers' writes reached the daemon one at a
// time: 4 KiB random writes of 4 jobs went from 14k to 23k a second, and
// on an allocated image from 16k to 36k.) The kernel invalidates the
// cached pages of the range before such a write, so buffered and mapped
// readers of the file see it (TestDirectWritersParallel). With the
// writeback cache, only if the kernel also writes the range's dirty pages
// back first (KernelFlags), else one written back later would overwrite
// the direct write.
func (m *mount) openFlags(write bool, flags uint32, cached bool) uint32 {
	if write && (!cached || flags&syscall.O_DIRECT != 0 && m.directViews()) {
		return fuse.FOPEN_KEEP_CACHE | fuse.FOPEN_DIRECT_IO | fuse.FOPEN_PARALLEL_DIRECT_WRITES
	}
	if !cached {
		return fuse.FOPEN_KEEP_CACHE | fuse.FOPEN_DIRECT_IO
	}
	return fuse.FOPEN_KEEP_CACHE
}

// fileSize is the size of the node's file now: the live disk's when the
// image is open (a resize changes it), else as listed.
func (n *imageNode) fileSize(oi *openImage) int64 {
	if n.part != 0 {
		return n.size
	}
	if oi == nil {
		if oi = n.m.openNow(n.disk()); oi != nil {
			defer n.m.release(oi)
		}
	}
	if oi != nil {
		return oi.image().Size()
	}
	return n.m.diskSize(n.disk(), n.size)
}

// Getattr reports the image file's attributes with the virtual size.
func (n *imageNode) Getattr(ctx context.Context, f gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	var oi *openImage
	if h, ok := f.(*imageHandle); ok {
		oi = h.oi
	}
	x := *n.x
	x.part, x.size = n.part, n.fileSize(oi)
	if n.m.cfg.Writable {
		// Times follow the image file as writes change it.
		if st, err := n.m.src.stat(x.e.rel); err == nil && keyOf(&st) == x.e.key {
			e := *x.e
			e.st.Mtim, e.st.Ctim, e.st.Atim = st.Mtim, st.Ctim, st.Atim
			x.e = &e
		}
	}
	if n.m.fillAttr(&out.Attr, &x) && !n.writable() {
		out.SetTimeout(imageAttrTimeout)
	}
	return 0
}

// Setattr grows the disk when the file's size is set larger (truncate -s,
// ftruncate); shrinking is refused and changes nothing. Other attributes
// (mode, owner, times) belong to the image file and are not changed
// through the mount.
func (n *imageNode) Setattr(ctx context.Context, f gofs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	size, ok := in.GetSize()
	if !ok {
		return n.Getattr(ctx, f, out)
	}
	if n.part != 0 || !n.writable() {
		return syscall.EROFS
	}
	h, _ := f.(*imageHandle)
	oi := (*openImage)(nil)
	if h != nil && h.write {
		oi = h.oi
	} else {
		var err error
		if oi, err = n.m.openHandle(n.disk(), n.x.e.rel, true); err != nil {
			return errnoOf(err)
		}
		defer n.m.closeHandle(oi, true)
	}
	if int64(size) == oi.image().Size() {
		return n.Getattr(ctx, f, out)
	}
	if int64(size) < oi.image().Size() {
		n.m.log.Warn("resize refused: a disk cannot shrink", "image", oi.imagePath(), "size", size, "now", oi.image().Size())
		return syscall.EPERM
	}
	img, err := n.m.writeTarget(oi)
	if err != nil {
		return errnoOf(err)
	}
	old := img.Size()
	if err := img.Resize(int64(size)); err != nil {
		n.m.log.Warn("resize refused", "image", oi.imagePath(), "size", size, "reason", err.Error())
		return errnoOf(err)
	}
	n.m.grown(oi.d, img.Size())
	n.grewViews()
	n.vw.grew(old, img.Size())
	n.m.wrote(oi)
	return n.Getattr(ctx, f, out)
}

// imageHandle is one open of an image node: reads, writes, lseek,
// fallocate and fsync are answered here, against the image the handle
// holds.
type imageHandle struct {
	n      *imageNode
	oi     *openImage
	write  bool       // opened for writing
	cached bool       // through the page cache, as views.go decided
	holes  *holeWatch // reads meeting holes in the page cache (reread.go); nil but for cached read-only handles
}

var _ = (gofs.FileReader)((*imageHandle)(nil))

// Read serves a read from the image; requests run in parallel.
func (h *imageHandle) Read(ctx context.Context, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	n := h.n
	if h.holes != nil && h.holes.read(off, int64(len(dest))) {
		// Not in this request: the kernel waits for the locked pages of
		// the reads in flight, this one's included, to drop them.
		go n.NotifyContent(off+int64(len(dest)), 0)
	}
	if n.vw == nil {
		return n.m.read(h.oi, dest, n.start+off, n.start+n.fileSize(h.oi))
	}
	kind := n.m.kinds.of(ctx)
	n.vw.reading(n.start+off, int64(len(dest)), kind, h.cached)
	if kind == cachedIO {
		n.vw.cached()
	}
	return n.m.read(h.oi, dest, n.start+off, n.start+n.fileSize(h.oi))
}

var _ = (gofs.FileWriter)((*imageHandle)(nil))

// Write writes into the image; writes to different clusters run in
// parallel. A write past the end of the disk (or partition) is cut there
// and returns the bytes that fit; one that starts at the end fails with
// ENOSPC, as on a disk. With the writeback cache, such a write may come
// from the kernel writing back pages a write(2) put past the end, which
// grew the size the kernel keeps for the file: the node is replaced, and a
// short count of such a write fails (writeback.go).
func (h *imageHandle) Write(ctx context.Context, data []byte, off int64) (uint32, syscall.Errno) {
	n := h.n
	if !h.write {
		return 0, syscall.EBADF
	}
	end := n.fileSize(h.oi)
	if off+int64(len(data)) > end && n.m.cfg.WritebackCache {
		n.replace()
	}
	if off >= end {
		return 0, syscall.ENOSPC
	}
	data = data[:min(int64(len(data)), end-off)]
	kind := n.m.kinds.of(ctx)
	n.vw.writing(n.start+off, int64(len(data)), kind)
	img, err := n.m.writeTarget(h.oi)
	if err != nil {
		return 0, n.m.writeFailed(h.oi, off, err)
	}
	k, err := img.WriteAt(data, n.start+off)
	if k > 0 {
		n.vw.wrote(n.start+off, int64(k), kind)
	}
	if err != nil {
		return uint32(k), n.m.writeFailed(h.oi, off, err)
	}
	n.m.wrote(h.oi)
	return uint32(k), 0
}

var _ = (gofs.FileFsyncer)((*imageHandle)(nil))

// Fsync makes everything written to the image durable. It never answers
// ENOSYS (after which the kernel would take every fsync for a success), and
// fails for ever once a write or sync of the image failed. A partition
// table written meanwhile is shown from now on (tableWritten).
func (h *imageHandle) Fsync(ctx context.Context, flags uint32) syscall.Errno {
	if h.oi.pending.Load() {
		return 0 // nothing written yet
	}
	if err := h.oi.image().Flush(); err != nil {
		return h.n.m.writeFailed(h.oi, -1, err)
	}
	h.n.tableWritten(h.oi)
	// What was written back through the page cache is dropped from the
	// other views before the fsync returns.
	h.n.vw.barrier()
	return 0
}

var _ = (gofs.FileFlusher)((*imageHandle)(nil))

// Flush (on every close of a descriptor) writes the image's dirty metadata
// back.
func (h *imageHandle) Flush(ctx context.Context) syscall.Errno {
	if !h.write {
		return 0
	}
	return h.Fsync(ctx, 0)
}

var _ = (gofs.FileAllocater)((*imageHandle)(nil))

// Allocate is fallocate(2): PUNCH_HOLE|KEEP_SIZE discards (whole clusters
// are freed, and the image file's space with them), ZERO_RANGE makes zero
// clusters, mode 0 inside the disk is accepted (the range reads as before)
// and past its end grows it.
func (h *imageHandle) Allocate(ctx context.Context, off, size uint64, mode uint32) syscall.Errno {
	n := h.n
	if !h.write {
		return syscall.EBADF
	}
	end := n.fileSize(h.oi)
	o, l := int64(off), int64(size)
	if mode&^unix.FALLOC_FL_KEEP_SIZE == 0 && (o+l <= end || mode&unix.FALLOC_FL_KEEP_SIZE != 0) {
		return 0 // mode 0 inside the disk: the range reads as before
	}
	img, err := n.m.writeTarget(h.oi)
	if err != nil {
		return n.m.writeFailed(h.oi, o, err)
	}
	switch mode &^ unix.FALLOC_FL_KEEP_SIZE {
	case unix.FALLOC_FL_PUNCH_HOLE:
		if mode&unix.FALLOC_FL_KEEP_SIZE == 0 {
			return syscall.EOPNOTSUPP // (Linux requires KEEP_SIZE with it)
		}
		if o >= end {
			return 0
		}
		l = min(l, end-o)
		n.vw.writing(n.start+o, l, directIO)
		err := img.Discard(n.start+o, l)
		n.vw.wrote(n.start+o, l, directIO)
		if err != nil {
			return n.m.writeFailed(h.oi, o, err)
		}
	case unix.FALLOC_FL_ZERO_RANGE:
		if o+l > end && mode&unix.FALLOC_FL_KEEP_SIZE == 0 && n.part == 0 {
			if err := img.Resize(roundUp(o+l, 512)); err != nil {
				return n.m.writeFailed(h.oi, o, err)
			}
			n.m.grown(h.oi.d, img.Size())
			n.grewViews()
			n.vw.grew(end, img.Size())
			end = n.fileSize(h.oi)
		}
		if o < end {
			l = min(l, end-o)
			n.vw.writing(n.start+o, l, directIO)
			err := img.WriteZeroes(n.start+o, l)
			n.vw.wrote(n.start+o, l, directIO)
			if err != nil {
				return n.m.writeFailed(h.oi, o, err)
			}
		}
	case 0:
		if o+l > end && mode&unix.FALLOC_FL_KEEP_SIZE == 0 {
			if n.part != 0 {
				return syscall.ENOSPC
			}
			if err := img.Resize(roundUp(o+l, 512)); err != nil {
				return n.m.writeFailed(h.oi, o, err)
			}
			n.m.grown(h.oi.d, img.Size())
			n.grewViews()
			n.vw.grew(end, img.Size())
		}
	default:
		return syscall.EOPNOTSUPP
	}
	n.m.wrote(h.oi)
	return 0
}

// wrote records that oi's disk was written (data, zeros, a discard, a new
// size): its data count and its partition table, as read, no longer hold.
func (m *mount) wrote(oi *openImage) {
	m.usage.forget(oi.d)
	oi.writes.Add(1)
}

// grown records that disk d is now size bytes large.
func (m *mount) grown(d diskID, size int64) { m.resized.Store(d.base(), size) }

// diskSize is the size of disk d (a whole disk, not a snapshot) if this
// mount grew it since it was listed, else listed.
func (m *mount) diskSize(d diskID, listed int64) int64 {
	if d.part == 0 && d.snap == 0 {
		if v, ok := m.resized.Load(d.base()); ok {
			return max(v.(int64), listed)
		}
	}
	return listed
}

func roundUp(n, to int64) int64 { return (n + to - 1) / to * to }

var _ = (gofs.FileReleaser)((*imageHandle)(nil))

// Release gives the handle's use of the image back.
func (h *imageHandle) Release(ctx context.Context) syscall.Errno {
	h.n.vw.release(h.write, h.cached)
	h.n.m.closeHandle(h.oi, h.write)
	return 0
}
