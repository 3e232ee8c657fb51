package fs

import (
	"context"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// dirNode mirrors one source folder.
//
// A folder's scan (scan.go) is kept between requests and made again only
// when the folder itself changes (an entry added, removed or renamed
// changes its mtime): a lookup costs a stat of the folder and of the one
// entry, a listing a stat of every entry. An entry whose file changed is
// classified again on its own.
type dirNode struct {
	gofs.Inode
	noXattrs
	m    *mount
	rel  string // the source folder, relative to the source root
	only string // when set, the folder shows only this source entry

	// scanMu serializes the scans of this folder (they do I/O, so no
	// other folder waits for them) and guards cur.
	scanMu sync.Mutex
	cur    *dirScan

	staleChecked atomic.Pointer[dirScan] // the scan forgetStale last went through
}

var (
	_ = (gofs.NodeLookuper)((*dirNode)(nil))
	_ = (gofs.NodeReaddirer)((*dirNode)(nil))
	_ = (gofs.NodeGetattrer)((*dirNode)(nil))
)

// Lookup finds name in the source folder as it is now.
func (d *dirNode) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	s, err := d.scan(name)
	if err != nil {
		return nil, gofs.ToErrno(err)
	}
	d.forgetStale(s)
	x := s.names[name]
	if x == nil {
		if s.busy(name) {
			// An image another process writes: not listed, but
			// an open (or a stat) of its name says why it fails.
			return nil, syscall.EBUSY
		}
		return nil, syscall.ENOENT
	}
	node, stable := d.m.node(x)
	child := d.NewInode(ctx, node, stable)
	if x.kind() == kindImage {
		d.m.usage.watch(x.disk(), child)
	}
	if exact := d.m.fillAttr(&out.Attr, x); exact {
		out.SetAttrTimeout(imageAttrTimeout)
	}
	return child, 0
}

// forgetStale drops children whose source entry went away or changed
// generation, and tells the kernel to forget the name. The kernel holds the
// folder's lock while it waits for this request, so the notification is
// sent from another goroutine. It looks at the children once per scan:
// a listing's lookups (one per name) would otherwise each go through all
// of them, quadratic in the folder's size.
func (d *dirNode) forgetStale(s *dirScan) {
	if d.staleChecked.Swap(s) == s {
		return
	}
	for name, child := range d.Children() {
		x := s.names[name]
		if x != nil && x.disk().inode() == child.StableAttr().Ino && d.m.nodeGen(x) == child.StableAttr().Gen {
			continue
		}
		d.RmChild(name)
		go d.NotifyEntry(name)
	}
}

// Readdir lists the source folder as it is now, with "." and "..".
func (d *dirNode) Readdir(ctx context.Context) (gofs.DirStream, syscall.Errno) {
	s, err := d.scan("")
	if err != nil {
		return nil, gofs.ToErrno(err)
	}
	d.forgetStale(s)
	list := make([]fuse.DirEntry, 0, len(s.names)+2)
	list = append(list, fuse.DirEntry{Name: ".", Mode: syscall.S_IFDIR, Ino: d.inodeNumber()})
	parentIno := d.inodeNumber()
	if _, p := d.Parent(); p != nil {
		parentIno = p.StableAttr().Ino
	}
	list = append(list, fuse.DirEntry{Name: "..", Mode: syscall.S_IFDIR, Ino: parentIno})
	names := make([]string, 0, len(s.names))
	for name := range s.names {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		x := s.names[name]
		mode := uint32(syscall.S_IFREG)
		if k := x.kind(); k == kindDir || k == kindParts || k == kindBitmaps {
			mode = syscall.S_IFDIR
		}
		list = append(list, fuse.DirEntry{Name: name, Mode: mode, Ino: x.disk().inode()})
	}
	return gofs.NewListDirStream(list), 0
}

// folder is the folder itself (and the root's, for Root).
func (d *dirNode) folder() *dirNode { return d }

// inodeNumber is the folder's inode number: the root's is FUSE's root ID,
// 1; any other folder's is its source folder's.
func (d *dirNode) inodeNumber() uint64 {
	if d.IsRoot() {
		return fuse.FUSE_ROOT_ID
	}
	return d.StableAttr().Ino
}

// Getattr reports the source folder's attributes, without write bits.
func (d *dirNode) Getattr(ctx context.Context, f gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	st, err := d.m.src.stat(d.rel)
	if err != nil {
		return gofs.ToErrno(err)
	}
	d.m.fillAttr(&out.Attr, &shown{e: &entry{kind: kindDir, st: st, key: keyOf(&st)}})
	out.Ino = d.inodeNumber()
	return 0
}

// node makes the node for a shown entry.
func (m *mount) node(x *shown) (gofs.InodeEmbedder, gofs.StableAttr) {
	e := x.e
	stable := gofs.StableAttr{Ino: x.disk().inode(), Gen: m.nodeGen(x)}
	switch x.kind() {
	case kindDir:
		stable.Mode = syscall.S_IFDIR
		return &dirNode{m: m, rel: e.rel}, stable
	case kindParts:
		stable.Mode = syscall.S_IFDIR
		return &partsNode{m: m, disk: x}, stable
	case kindBitmaps:
		stable.Mode = syscall.S_IFDIR
		return &bitmapsNode{m: m, disk: x}, stable
	case kindImage:
		stable.Mode = syscall.S_IFREG
		if x.snap != 0 && x.snap <= maxSnapshotTables {
			// Each count opens the snapshot anew: the first ones of
			// a table get theirs, the others (thousands, in a
			// hostile table) keep the estimate.
			m.usage.request(x.disk(), usageJob{rel: e.rel, end: x.size})
		}
		return &imageNode{m: m, x: x, size: x.size}, stable
	default:
		stable.Mode = syscall.S_IFREG
		return &plainNode{m: m, rel: e.rel, key: e.key}, stable
	}
}

// fillAttr sets the attributes shown for x: the source file's owner, times
// and permission bits without write permission, and for disks the virtual
// size and the data they hold (usage.go). It reports whether the
// attributes are final: a disk whose data is not counted yet shows an
// estimate, which the kernel must not cache for long.
func (m *mount) fillAttr(a *fuse.Attr, x *shown) (final bool) {
	e := x.e
	a.FromStat(&e.st)
	a.Ino = x.disk().inode()
	switch x.kind() {
	case kindDir:
		a.Mode = e.st.Mode&^0o222&^syscall.S_IFMT | syscall.S_IFDIR
		return false
	case kindParts, kindBitmaps:
		// The image's read permissions, with search where read is.
		perm := e.st.Mode & 0o444
		a.Mode = perm | perm>>2 | syscall.S_IFDIR
		a.Size, a.Blocks, a.Nlink = 0, 0, 2
		return false
	}
	a.Mode = e.st.Mode&^0o222&^syscall.S_IFMT | syscall.S_IFREG
	if m.writableDisk(x) {
		a.Mode |= e.st.Mode & 0o222 // write permission as the image file has it
	}
	a.Blksize = 1 << 16
	if x.kind() != kindImage {
		a.Size = uint64(e.st.Size)
		return false
	}
	size := m.diskSize(x.disk(), x.size)
	a.Size = uint64(size)
	used, counted := m.usage.get(x.disk())
	if !counted {
		used = x.used()
		if oi := m.openNow(x.disk()); oi != nil {
			if oi.image().Writable() {
				// Being written: the host allocation now.
				used = min(oi.image().AllocatedBytes(), size)
			}
			m.release(oi)
		}
	}
	a.Blocks = (uint64(used) + 511) / 512
	a.Nlink = 1
	return counted
}

// writableDisk reports whether x is a disk (or partition) whose file can be
// written: in a writable mount, an image (not a snapshot) that can be
// written and is no other image's backing file (which in overlay mode
// does not matter: only overlays are written).
func (m *mount) writableDisk(x *shown) bool {
	return m.cfg.Writable && x.e.kind == kindImage && x.snap == 0 && x.part >= 0 &&
		x.e.facts != nil && x.e.facts.writable && (m.cfg.Overlay != "" || m.backingOf(x.e.key) == "")
}
