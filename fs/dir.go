package fs

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/qcowfs/qcowfs/qcow2"
)

// dirNode mirrors one source folder.
type dirNode struct {
	gofs.Inode
	m    *mount
	path string // the source folder
	only string // when set, the folder shows only this source entry

	mu      sync.Mutex
	entries map[string]*entry // by source name, kept between listings
}

var (
	_ = (gofs.NodeLookuper)((*dirNode)(nil))
	_ = (gofs.NodeReaddirer)((*dirNode)(nil))
	_ = (gofs.NodeGetattrer)((*dirNode)(nil))
)

type entryKind uint8

const (
	kindDir entryKind = iota
	kindImage
	kindPlain
	kindParts // the folder of a disk's partitions (parts.go)
)

// snapshotEntry is what a listing keeps of an image's snapshot.
type snapshotEntry struct {
	id, name string
	size     int64
}

// entry is one source entry as the mount shows it.
type entry struct {
	src     string // name in the source folder
	path    string // full source path (of the symlink target for symlinks)
	kind    entryKind
	v       version
	st      syscall.Stat_t
	size    int64 // the size shown: the virtual size for images
	used    int64 // images: bytes on the host, an estimate of the data
	hidden  bool  // an image that failed validation, or an entry we do not show
	exposed string
	clashed bool // not shown for a name clash; logged once

	snaps []snapshotEntry // images: their internal snapshots
	snap  string          // a snapshot entry: its ID (kind is kindImage)
	part  int             // a partition, or partsFolder (kindParts)
	held  *openImage      // images: kept open (and locked) while listed
	// locked: an image not shown because another process holds its
	// write lock; it is tried again at every listing.
	locked bool
}

// disk names the disk an image or snapshot entry shows.
func (e *entry) disk() diskID { return diskID{v: e.v, snap: e.snap, part: e.part} }

// list reads the source folder and returns its entries by exposed name.
// Entries whose file did not change since the last listing are reused, so
// an image is validated (opened) once per version, and a refused image is
// logged once per version.
func (d *dirNode) list() (map[string]*entry, error) {
	var names []string
	if d.only != "" {
		names = []string{d.only}
	} else {
		f, err := os.Open(d.path)
		if err != nil {
			return nil, err
		}
		names, err = f.Readdirnames(-1)
		f.Close()
		if err != nil {
			return nil, err
		}
	}

	d.mu.Lock()
	defer d.mu.Unlock()
	old := d.entries
	d.entries = make(map[string]*entry, len(names))
	var shown []*entry
	for _, name := range names {
		e := d.classify(name, old[name])
		if e == nil {
			continue
		}
		d.entries[name] = e
		if !e.hidden {
			shown = append(shown, e)
		}
	}
	// Images that went away or changed are no longer held open.
	for name, e := range old {
		if e.held != nil && d.entries[name] != e {
			d.m.release(e.disk(), e.held)
		}
	}

	srcs := make([]string, len(shown))
	isImage := make([]bool, len(shown))
	for i, e := range shown {
		srcs[i], isImage[i] = e.src, e.kind == kindImage
	}
	out := make(map[string]*entry, len(shown))
	var images []*entry
	for i, name := range assignNames(srcs, isImage) {
		e := shown[i]
		if name == "" {
			if !e.clashed {
				d.m.log.Warn("image not shown: its name and its fallback name are both taken", "image", e.path)
			}
			e.clashed = true
			continue
		}
		e.clashed = false
		e.exposed = name
		out[name] = e
		if len(e.snaps) > 0 {
			images = append(images, e)
		}
	}
	// Snapshots last, by image name then table order (names.go, rule 4).
	sort.Slice(images, func(i, j int) bool { return images[i].exposed < images[j].exposed })
	for _, img := range images {
		for _, sn := range img.snaps {
			name, fallback := snapshotNames(img.exposed, sn.id, sn.name)
			if out[name] != nil {
				name = fallback
			}
			if out[name] != nil {
				continue
			}
			out[name] = &entry{src: img.src, path: img.path, kind: kindImage, v: img.v, st: img.st,
				size: sn.size, used: min(img.used, sn.size), exposed: name, snap: sn.id}
		}
	}
	// The folders of partitions, after every other name (parts.go).
	if !d.m.cfg.NoPartitions {
		var disks []*entry
		for _, e := range out {
			if e.kind == kindImage {
				disks = append(disks, e)
			}
		}
		sort.Slice(disks, func(i, j int) bool { return disks[i].exposed < disks[j].exposed })
		for _, e := range disks {
			name := partsName(e.exposed)
			if out[name] != nil {
				continue
			}
			if t := d.m.partitionTable(e.path, e.disk()); t != nil && len(shownPartitions(t)) > 0 {
				out[name] = &entry{src: e.src, path: e.path, kind: kindParts, v: e.v, st: e.st, snap: e.snap,
					part: partsFolder, exposed: name, used: e.used}
			}
		}
	}
	return out, nil
}

// classify stats one source entry and, for a new or changed qcow2 image,
// validates it. It returns nil for entries that do not exist any more.
func (d *dirNode) classify(name string, old *entry) *entry {
	path := filepath.Join(d.path, name)
	var st syscall.Stat_t
	if err := syscall.Lstat(path, &st); err != nil {
		return nil
	}
	if st.Mode&syscall.S_IFMT == syscall.S_IFLNK {
		// Follow symlinks only to what lies inside the source folder:
		// nothing outside what the user mounted is ever served.
		target, err := filepath.EvalSymlinks(path)
		if err != nil || !inside(target, d.m.root) {
			if old == nil || old.kind != kindPlain || !old.hidden {
				d.m.log.Warn("symlink not shown: it does not resolve inside the source folder", "path", path)
			}
			return &entry{src: name, path: path, kind: kindPlain, hidden: true}
		}
		if err := syscall.Stat(target, &st); err != nil {
			return nil
		}
		path = target
	}
	v := versionOf(&st)
	if old != nil && old.v == v && old.path == path && !old.locked {
		return old
	}
	e := &entry{src: name, path: path, v: v, st: st, size: st.Size}
	if old != nil && old.v == v {
		// An image refused for a lock is tried again at every listing
		// (qemu may have let go), but logged once.
		e.locked = old.locked
	}
	switch st.Mode & syscall.S_IFMT {
	case syscall.S_IFDIR:
		e.kind = kindDir
		e.size = 0
	case syscall.S_IFREG:
		e.kind = kindPlain
		if ok, _ := qcow2.IsQcow2(path); ok {
			e.kind = kindImage
			d.validate(e)
		}
	default:
		// Devices, fifos and sockets are not shown: reading a fifo
		// would block a reader forever.
		e.hidden = true
	}
	return e
}

// validate opens the image, checking it, and keeps it open (and locked
// against writers) while the listing shows it.
func (d *dirNode) validate(e *entry) {
	oi, err := d.m.acquire(e.path, e.disk())
	if err != nil {
		e.hidden = true
		wasLocked := e.locked
		e.locked = errors.Is(err, qcow2.ErrLocked)
		if !wasLocked || !e.locked {
			d.m.log.Error("image not shown", "image", e.path, "reason", err.Error())
		}
		return
	}
	e.locked = false
	img := oi.img
	e.held = oi
	e.size = img.Size()
	e.used = min(img.AllocatedBytes(), e.size)
	for _, s := range img.Snapshots() {
		e.snaps = append(e.snaps, snapshotEntry{id: s.ID, name: s.Name, size: s.Size})
	}
	d.m.usage.request(e.disk(), usageJob{path: e.path, end: e.size})
}

var _ = (gofs.NodeOnForgetter)((*dirNode)(nil))

// OnForget lets go of the images the folder's listing held, once the
// kernel has forgotten the folder.
func (d *dirNode) OnForget() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, e := range d.entries {
		if e.held != nil {
			d.m.release(e.disk(), e.held)
		}
	}
	d.entries = nil
}

// inside reports whether path is root or lies below it.
func inside(path, root string) bool {
	return path == root || root == "/" || strings.HasPrefix(path, root+"/")
}

// Lookup finds name in the source folder as it is now.
func (d *dirNode) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	entries, err := d.list()
	if err != nil {
		return nil, gofs.ToErrno(err)
	}
	d.forgetStale(entries)
	e := entries[name]
	if e == nil {
		return nil, syscall.ENOENT
	}
	var node gofs.InodeEmbedder
	stable := gofs.StableAttr{Ino: e.disk().inode()}
	switch e.kind {
	case kindDir:
		node = &dirNode{m: d.m, path: e.path}
		stable.Mode = syscall.S_IFDIR
	case kindParts:
		disk := e.disk().base()
		img := *e
		img.kind, img.part = kindImage, 0
		node = &partsNode{m: d.m, path: e.path, d: disk, table: d.m.partitionTable(e.path, disk), img: &img}
		stable.Mode, stable.Gen = syscall.S_IFDIR, e.v.generation()
	case kindImage:
		node = &imageNode{m: d.m, path: e.path, d: e.disk(), size: e.size, used: e.used}
		if e.snap != "" {
			d.m.usage.request(e.disk(), usageJob{path: e.path, end: e.size})
		}
		stable.Mode, stable.Gen = syscall.S_IFREG, e.v.generation()
	default:
		node = &plainNode{m: d.m, path: e.path, v: e.v}
		stable.Mode, stable.Gen = syscall.S_IFREG, e.v.generation()
	}
	child := d.NewInode(ctx, node, stable)
	if e.kind == kindImage {
		d.m.usage.watch(e.disk(), child)
	}
	if exact := d.m.fillAttr(&out.Attr, e); exact {
		out.SetAttrTimeout(imageAttrTimeout)
	}
	return child, 0
}

// forgetStale drops children whose source entry went away or changed, and
// tells the kernel to forget the name. The kernel holds the folder's lock
// while it waits for this request, so the notification is sent from
// another goroutine.
func (d *dirNode) forgetStale(entries map[string]*entry) {
	for name, child := range d.Children() {
		e := entries[name]
		if e != nil && e.disk().inode() == child.StableAttr().Ino &&
			(e.kind == kindDir || e.v.generation() == child.StableAttr().Gen) {
			continue
		}
		d.RmChild(name)
		go d.NotifyEntry(name)
	}
}

// Readdir lists the source folder as it is now.
func (d *dirNode) Readdir(ctx context.Context) (gofs.DirStream, syscall.Errno) {
	entries, err := d.list()
	if err != nil {
		return nil, gofs.ToErrno(err)
	}
	d.forgetStale(entries)
	list := make([]fuse.DirEntry, 0, len(entries))
	for name, e := range entries {
		mode := uint32(syscall.S_IFREG)
		if e.kind == kindDir || e.kind == kindParts {
			mode = syscall.S_IFDIR
		}
		list = append(list, fuse.DirEntry{Name: name, Mode: mode, Ino: e.disk().inode()})
	}
	return gofs.NewListDirStream(list), 0
}

// Getattr reports the source folder's attributes, without write bits.
func (d *dirNode) Getattr(ctx context.Context, f gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	var st syscall.Stat_t
	if err := syscall.Stat(d.path, &st); err != nil {
		return gofs.ToErrno(err)
	}
	e := &entry{kind: kindDir, st: st, v: versionOf(&st)}
	d.m.fillAttr(&out.Attr, e)
	if d.IsRoot() {
		out.Ino = 1
	}
	return 0
}

// fillAttr sets the attributes shown for e: the source file's owner,
// times and permission bits without write permission, and for images the
// virtual size and the data they hold (usage.go). It reports whether the
// attributes are final: an image whose data is not counted yet shows an
// estimate, which the kernel must not cache for long.
func (m *mount) fillAttr(a *fuse.Attr, e *entry) (final bool) {
	a.FromStat(&e.st)
	a.Ino = e.disk().inode()
	a.Mode = e.st.Mode&^0o222&^syscall.S_IFMT | syscall.S_IFREG
	switch e.kind {
	case kindDir:
		a.Mode = e.st.Mode&^0o222&^syscall.S_IFMT | syscall.S_IFDIR
	case kindParts:
		// The image's read permissions, with search where read is.
		perm := e.st.Mode & 0o444
		a.Mode = perm | perm>>2 | syscall.S_IFDIR
		a.Size, a.Blocks, a.Nlink = 0, 0, 2
		return false
	}
	a.Size = uint64(e.size)
	a.Blksize = 1 << 16
	if e.kind != kindImage {
		return false
	}
	used, counted := m.usage.get(e.disk())
	if !counted {
		used = e.used
	}
	a.Blocks = (uint64(used) + 511) / 512
	a.Nlink = 1
	return counted
}
