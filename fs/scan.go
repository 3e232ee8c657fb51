package fs

import (
	"errors"
	"fmt"
	"hash/fnv"
	"maps"
	"runtime/debug"
	"sort"
	"strings"
	"syscall"

	"github.com/qcowfs/qcowfs/partition"
	"github.com/qcowfs/qcowfs/qcow2"
)

// A folder's scan: what each source entry is (classify), what an image
// holds (validate), and the names the mount shows for them (names.go).
//
// Validating an image opens it without locks, like qemu-img info -U, reads
// what the listing needs (virtual size, snapshots, partition tables) and
// closes it again: a listed image holds neither locks nor descriptors. What
// was learned is kept with the entry and used again until the file
// changes. An image a running qemu writes (it holds qemu's write lock) is
// not shown, and is tried again at every listing, without taking a lock.

type entryKind uint8

const (
	kindDir entryKind = iota
	kindImage
	kindPlain
	kindParts   // the folder of a disk's partitions (parts.go)
	kindBitmaps // the folder of a disk's bitmap views (bitmaps.go)
)

// entry is one source entry, classified.
type entry struct {
	src  string         // name in the source folder
	rel  string         // path relative to the source root (of the target, for symlinks)
	lst  syscall.Stat_t // the entry itself (the symlink, for symlinks)
	st   syscall.Stat_t // what it shows (the target, for symlinks)
	key  fileKey
	kind entryKind
	gen  uint64 // images: the generation classified

	facts *imageFacts // images that validated

	hidden bool
	why    *refusal // why an image is not shown; logged once per version
	locked bool     // not shown because a qemu writes it: tried again at every scan
	retry  bool     // not shown for a passing reason (locked, out of descriptors or memory): tried again at every scan
	noted  bool     // a hidden symlink or a name clash was logged

	snapsNoted bool // snapshots without a usable name were logged
}

// imageFacts is what validation learned of an image.
type imageFacts struct {
	writable bool  // the image can be written (in a writable mount)
	size     int64 // virtual size
	used     int64 // space its files take on the host: a first estimate of its data
	snaps    []snapFacts
	table    *partition.Table // partitions of the current disk; nil if none shown
	// bitmaps get views (bitmaps.go); hiddenBitmaps are the others, with
	// the reasons (logged once).
	bitmaps       []bitmapFacts
	hiddenBitmaps map[string]string
}

type snapFacts struct {
	index    int // 1 + index in the snapshot table
	id, name string
	size     int64
	table    *partition.Table
	err      string // why qemu cannot load it (not shown); "" if it can
}

// A refusal says why an image is not shown, and what would change that.
type refusal struct {
	image  string
	reason string
	hint   string
	err    error // the library's error
}

// shown is one name the folder shows: an entry, or a snapshot or the
// partitions folder of a disk.
type shown struct {
	e     *entry
	snap  int // 1 + snapshot index; 0 for the image's current state
	part  int // partsFolder or bitmapsFolder for a disk's folder of partitions or bitmap views, a partition's number (parts.go), else 0
	start int64
	size  int64            // a partition's byte range is [start, start+size)
	table *partition.Table // partitions folders: the disk's partitions
}

func (x *shown) kind() entryKind {
	switch x.part {
	case partsFolder:
		return kindParts
	case bitmapsFolder:
		return kindBitmaps
	}
	return x.e.kind
}

func (x *shown) disk() diskID {
	if x.e.kind != kindImage {
		return diskID{key: x.e.key}
	}
	return diskID{key: x.e.key, gen: x.e.gen, snap: x.snap, part: x.part}
}

// gen is the node generation: for disks and their partitions the file's
// generation (identity.go), mixed with where the entry lies in the source.
// A node keeps its source path for life, so an entry that moved (a folder
// renamed, and another put in its place) must be a new node: otherwise the
// kernel would be handed the old node, which still resolves the old path.
// So must a partitions folder whose table changed (its lookups and listing
// go by the table it was made with), a bitmaps folder whose views did, and
// a partition whose range did (the kernel's cached pages of the old one are
// of another range).
func (x *shown) gen() uint64 {
	h := fnv.New64a()
	h.Write([]byte(x.e.rel))
	switch {
	case x.part == partsFolder:
		h.Write([]byte(layout(x.table)))
	case x.part == bitmapsFolder:
		h.Write([]byte("\x00bitmaps\x00" + layoutBitmaps(x.e.facts.bitmaps)))
	case x.part > 0:
		fmt.Fprintf(h, "\x00%d+%d", x.start, x.size)
	}
	g := h.Sum64()
	if x.e.kind == kindImage {
		g ^= x.e.gen * 0x9e3779b97f4a7c15
	}
	return g | 1
}

// used is the first estimate of a disk's data bytes.
func (x *shown) used() int64 {
	if x.e.facts == nil {
		return 0
	}
	return min(x.e.facts.used, x.size)
}

// dirScan is one folder as last scanned.
type dirScan struct {
	dir     fileKey
	ver     version
	entries map[string]*entry // by source name
	names   map[string]*shown // by shown name
}

// busy reports whether name is a name an image would have (names.go, its
// preferred or its fallback name) that is not shown because another
// process holds its lock (a qemu, another qcowfs writing it).
func (s *dirScan) busy(name string) bool {
	for _, e := range s.entries {
		if e.locked && (preferredName(e.src) == name || fallbackName(e.src) == name) {
			return true
		}
	}
	return false
}

// scan returns the folder's scan, made again if the folder changed; for a
// lookup of name only that name's entry is checked for changes, for a
// listing (name "") every entry.
func (d *dirNode) scan(name string) (*dirScan, error) {
	d.scanMu.Lock()
	defer d.scanMu.Unlock()
	dir, err := d.m.src.folder(d.rel)
	if err != nil {
		return nil, err
	}
	defer dir.Close()
	st, err := dir.stat()
	if err != nil {
		return nil, err
	}
	cur := d.cur
	if cur == nil || cur.dir != keyOf(&st) || cur.ver != versionOf(&st) {
		s, err := d.rescan(dir, cur, &st)
		if err != nil {
			return nil, err
		}
		d.cur = s
		return s, nil
	}
	var check []*entry
	if name == "" {
		for _, e := range cur.entries {
			check = append(check, e)
		}
	} else if x := cur.names[name]; x != nil {
		check = append(check, x.e)
	} else {
		// Not shown: it may be an image a qemu let go of since, or
		// the partitions (or bitmaps) folder of a disk that has a table
		// (bitmaps) since.
		for _, e := range cur.entries {
			if e.locked {
				check = append(check, e)
			}
		}
		for _, suffix := range []string{partsSuffix, bitmapsSuffix} {
			if disk, ok := strings.CutSuffix(name, suffix); ok && cur.names[disk] != nil {
				check = append(check, cur.names[disk].e)
			}
		}
	}
	changed := false
	entries := cur.entries
	for _, e := range check {
		ne := d.classify(dir, e.src, e)
		if ne == e {
			continue
		}
		if !changed {
			entries = make(map[string]*entry, len(cur.entries))
			for k, v := range cur.entries {
				entries[k] = v
			}
			changed = true
		}
		if ne == nil {
			delete(entries, e.src)
		} else {
			entries[e.src] = ne
		}
	}
	if changed {
		d.cur = &dirScan{dir: cur.dir, ver: cur.ver, entries: entries, names: d.m.assign(entries)}
	}
	return d.cur, nil
}

// takeTable shows t as the partition table of the disk shown as name,
// whose writer read it from the disk (tableWritten), if it differs from
// the table shown. It returns the name of the partitions folder that
// changed (appeared, went or shows other partitions), or "".
func (d *dirNode) takeTable(name string, t *partition.Table) string {
	d.scanMu.Lock()
	defer d.scanMu.Unlock()
	cur := d.cur
	var x *shown
	if cur != nil {
		x = cur.names[name]
	}
	if x == nil || x.kind() != kindImage || x.snap != 0 || x.e.facts == nil || layout(x.e.facts.table) == layout(t) {
		return ""
	}
	e, f := *x.e, *x.e.facts
	f.table, e.facts = t, &f
	entries := maps.Clone(cur.entries)
	entries[e.src] = &e
	d.cur = &dirScan{dir: cur.dir, ver: cur.ver, entries: entries, names: d.m.assign(entries)}
	return partsName(name)
}

// rescan reads the folder's names again and classifies every entry,
// keeping the classification of entries that did not change.
func (d *dirNode) rescan(dir folder, old *dirScan, st *syscall.Stat_t) (*dirScan, error) {
	var names []string
	if d.only != "" {
		names = []string{d.only}
	} else {
		var err error
		if names, err = dir.names(); err != nil {
			return nil, err
		}
	}
	s := &dirScan{dir: keyOf(st), ver: versionOf(st), entries: make(map[string]*entry, len(names))}
	for _, name := range names {
		var prev *entry
		if old != nil {
			prev = old.entries[name]
		}
		if e := d.classify(dir, name, prev); e != nil {
			s.entries[name] = e
		}
	}
	s.names = d.m.assign(s.entries)
	return s, nil
}

// classify stats one source entry and, for a new or changed qcow2 image,
// validates it. It returns old if nothing changed, and nil for an entry
// that does not exist any more.
func (d *dirNode) classify(dir folder, name string, old *entry) *entry {
	m := d.m
	since := m.ids.now()
	lst, err := dir.lstat(name)
	if err != nil {
		return nil
	}
	rel := join(d.rel, name)
	e := &entry{src: name, rel: rel, lst: lst, st: lst, key: keyOf(&lst)}
	if lst.Mode&syscall.S_IFMT == syscall.S_IFLNK {
		// Follow symlinks only to what lies inside the source folder:
		// nothing outside what the user mounted is ever served.
		target, err := m.src.resolveLink(rel)
		if err == nil {
			e.st, err = m.src.stat(target)
		}
		if err != nil {
			e.kind, e.hidden = kindPlain, true
			if old == nil || !old.noted || !unchanged(&old.lst, &lst) {
				m.log.Warn("symlink not shown: it does not resolve inside the source folder", "path", m.src.abs(rel), "reason", err.Error())
			}
			e.noted = true
			return e
		}
		e.rel, e.key = target, keyOf(&e.st)
	}
	if old != nil && unchanged(&old.lst, &lst) && unchanged(&old.st, &e.st) && old.rel == e.rel && !old.retry {
		return old
	}
	switch e.st.Mode & syscall.S_IFMT {
	case syscall.S_IFDIR:
		e.kind = kindDir
	case syscall.S_IFREG:
		e.kind = kindPlain
		isQcow2, magic := m.src.probe(e.rel)
		switch {
		case isQcow2:
			e.kind = kindImage
			m.validate(e, old, since)
		case !m.src.showsPlain():
			e.hidden = true
		case magic:
			// Logged once per version of the file, as a refusal.
			m.log.Warn("shown as a plain file: it begins with the qcow2 magic, but qemu reads it as a raw file (a version of 0: cut short, or damaged)",
				"path", m.src.abs(e.rel), "size", e.st.Size)
		}
	default:
		// Devices, fifos and sockets are not shown: reading a fifo
		// would block a reader forever.
		e.hidden = true
	}
	return e
}

// unchanged reports whether two stats of a file say it is the same file
// with the same content and attributes (reads change the access time
// only, which does not count; any change of mode or owner moves ctime).
func unchanged(a, b *syscall.Stat_t) bool {
	return keyOf(a) == keyOf(b) && versionOf(a) == versionOf(b)
}

// maxSnapshotTables bounds how many snapshots of one image get their
// partition table read (one open each), so that a table of thousands of
// snapshots does not make every listing slow.
const maxSnapshotTables = 64

// validate opens the image e without locks and records what it holds, or
// why it is not shown. old is the entry's previous classification, for
// logging a refusal once; since is identities.now from before e was
// statted.
func (m *mount) validate(e *entry, old *entry, since uint64) {
	defer func() {
		// A panic of the library on this image (or its partition
		// table) hides this image only; the folder's other entries are
		// shown as usual.
		if r := recover(); r != nil {
			m.log.Error("internal error (panic) validating an image; only this image is affected",
				"image", m.src.abs(e.rel), "panic", fmt.Sprint(r), "stack", string(debug.Stack()))
			e.hidden, e.facts = true, nil
			e.why = &refusal{image: m.src.abs(e.rel), reason: fmt.Sprintf("internal error: %v", r)}
		}
	}()
	e.gen = m.ids.observe(e.key, versionOf(&e.st), since)
	d := diskID{key: e.key, gen: e.gen}
	oi, err := m.acquire(d, e.rel)
	if err == nil && !m.cfg.ForceShare {
		if err = oi.image().LockConflict(); err != nil {
			m.release(oi)
		}
	}
	if err != nil {
		e.hidden = true
		e.locked = errors.Is(err, qcow2.ErrLocked)
		e.retry = e.locked || passing(err)
		e.why = m.refusalOf(e.rel, err)
		// Logged once per version of the file. An image a qemu
		// writes changes all the time while it is tried again at every
		// scan: logged once until it is shown again.
		again := old != nil && old.why != nil && old.why.reason == e.why.reason &&
			(e.locked || unchanged(&old.st, &e.st))
		if !again {
			args := []any{"image", e.why.image, "reason", e.why.reason}
			if e.why.hint != "" {
				args = append(args, "hint", e.why.hint)
			}
			m.log.Warn("image not shown", args...)
		}
		m.noteRefusal(e.why.image, err)
		return
	}
	defer m.release(oi)
	m.noteRefusal(m.src.abs(e.rel), nil)
	m.noteImage(e.key, m.src.abs(e.rel))
	if old != nil && old.locked {
		m.log.Info("image shown again: no other process writes it now", "image", m.src.abs(e.rel))
	}
	// The disk as served (through its overlay, if it has one), with
	// the original's snapshots and backing files.
	img := oi.image()
	f := &imageFacts{size: img.Size(), used: min(img.AllocatedBytes(), img.Size()), writable: img.Writable() || oi.pending.Load()}
	var chain []fileKey
	for _, b := range oi.orig.Chain() {
		if fd, ok := b.(interface{ Fd() uintptr }); ok {
			var st syscall.Stat_t
			if syscall.Fstat(int(fd.Fd()), &st) == nil {
				chain = append(chain, keyOf(&st))
			}
		}
	}
	if len(chain) > 0 {
		m.noteBacking(m.src.abs(e.rel), chain)
	}
	if !m.cfg.NoPartitions {
		f.table = m.readPartitions(img, m.src.abs(e.rel))
	}
	unloadable := 0
	for i, s := range oi.orig.Snapshots() {
		sf := snapFacts{index: i + 1, id: s.ID, name: s.Name, size: s.Size}
		if s.Err != nil {
			sf.err = s.Err.Error()
			if unloadable++; unloadable == 1 && (old == nil || old.facts == nil || !sameSnapErrs(old.facts, i, sf.err)) {
				m.log.Warn("snapshot not shown: qemu cannot load it either", "image", m.src.abs(e.rel),
					"snapshot", s.ID, "reason", strings.TrimPrefix(sf.err, m.src.abs(e.rel)+": "))
			}
			f.snaps = append(f.snaps, sf)
			continue
		}
		if !m.cfg.NoPartitions && i < maxSnapshotTables {
			if so, err := m.acquire(diskID{key: e.key, gen: e.gen, snap: i + 1}, e.rel); err == nil {
				sf.table = m.readPartitions(so.image(), describe(m.src.abs(e.rel), s.ID))
				m.release(so)
			}
		} else if i == maxSnapshotTables && !m.cfg.NoPartitions {
			m.log.Warn("partitions of further snapshots not shown", "image", m.src.abs(e.rel), "snapshots", len(oi.orig.Snapshots()), "limit", maxSnapshotTables)
		}
		f.snaps = append(f.snaps, sf)
	}
	if !m.cfg.NoBitmapViews {
		// The image file's bitmaps (in overlay mode, the original's).
		var hidden map[string]string
		if old != nil && old.facts != nil {
			hidden = old.facts.hiddenBitmaps
		}
		f.bitmaps, f.hiddenBitmaps = m.readBitmaps(oi.orig, m.src.abs(e.rel), hidden)
	}
	e.facts = f
	m.usage.request(d, usageJob{rel: e.rel, end: f.size})
}

// sameSnapErrs reports whether snapshot i was refused for reason err at
// the previous validation too (so the line is not logged again).
func sameSnapErrs(f *imageFacts, i int, err string) bool {
	return i < len(f.snaps) && f.snaps[i].err == err
}

// readPartitions reads a disk's partition table; nil if it has none or no
// partition of it would be shown. Problems are logged.
func (m *mount) readPartitions(img *qcow2.Image, what string) *partition.Table {
	t, err := partitionsOf(img)
	m.logTable(t, err, what)
	return shownTable(t)
}

// partitionsOf reads a disk's partition table: nil if it has none, and an
// error if it cannot be used.
func partitionsOf(img *qcow2.Image) (*partition.Table, error) {
	t, err := partition.Read(img, img.Size(), 0)
	if errors.Is(err, partition.ErrNoTable) {
		return nil, nil
	}
	return t, err
}

// logTable logs the problems of a table read from the disk what.
func (m *mount) logTable(t *partition.Table, err error, what string) {
	if err != nil {
		m.log.Warn("partition table not shown", "disk", what, "reason", err.Error())
		return
	}
	if t != nil {
		for _, w := range t.Warnings {
			m.log.Warn("partition table", "disk", what, "warning", w)
		}
	}
}

// passing reports whether err is a refusal for want of something other
// images hold (descriptors, room in the memory budget), which the next
// scan may find free again.
func passing(err error) bool {
	var be *qcow2.BudgetError
	if errors.As(err, &be) {
		return be.Held+be.Need <= be.Limit
	}
	return errors.Is(err, syscall.EMFILE)
}

// refusalOf describes why the image at rel cannot be shown, with what
// would show it where the configuration knows.
func (m *mount) refusalOf(rel string, err error) *refusal {
	path := m.src.abs(rel)
	r := &refusal{image: path, reason: strings.TrimPrefix(err.Error(), path+": "), err: err}
	if m.cfg.Hint != nil {
		r.hint = m.cfg.Hint(err)
	}
	return r
}

// assign gives the folder's entries their shown names (names.go): entries,
// then snapshots, then partitions folders, then bitmaps folders.
func (m *mount) assign(entries map[string]*entry) map[string]*shown {
	var vis []*entry
	for _, e := range entries {
		if !e.hidden {
			vis = append(vis, e)
		}
	}
	sort.Slice(vis, func(i, j int) bool { return vis[i].src < vis[j].src })
	srcs := make([]string, len(vis))
	isImage := make([]bool, len(vis))
	for i, e := range vis {
		srcs[i], isImage[i] = e.src, e.kind == kindImage
	}
	out := make(map[string]*shown, len(vis))
	names := make(map[*shown]string)
	var images []*shown
	for i, name := range assignNames(srcs, isImage) {
		e := vis[i]
		if name == "" {
			if !e.noted {
				m.log.Warn("image not shown: its name and its fallback name are both taken", "image", m.src.abs(e.rel))
				e.noted = true
			}
			continue
		}
		x := &shown{e: e}
		if e.kind == kindImage {
			x.size = e.facts.size
			images = append(images, x)
			names[x] = name
		}
		out[name] = x
	}
	sort.Slice(images, func(i, j int) bool { return names[images[i]] < names[images[j]] })
	// Snapshots, by image name then table order (names.go, rule 4).
	var disks []*shown
	taken := func(n string) bool { return out[n] != nil }
	for _, img := range images {
		disks = append(disks, img)
		unshown := 0
		for _, sn := range img.e.facts.snaps {
			if sn.err != "" {
				continue // qemu cannot load it either; logged at validation
			}
			name, fallback := snapshotNames(names[img], sn.id, sn.name)
			if !usable(name, taken) {
				name = fallback
			}
			if !usable(name, taken) {
				unshown++
				continue
			}
			x := &shown{e: img.e, snap: sn.index, size: sn.size}
			out[name] = x
			names[x] = name
			disks = append(disks, x)
		}
		if unshown > 0 && !img.e.snapsNoted {
			m.log.Warn("snapshots not shown: their names and ID names are taken or longer than 255 bytes",
				"image", m.src.abs(img.e.rel), "snapshots", unshown)
			img.e.snapsNoted = true
		}
	}
	// The folders of partitions, after every other name (parts.go).
	if !m.cfg.NoPartitions {
		sort.Slice(disks, func(i, j int) bool { return names[disks[i]] < names[disks[j]] })
		for _, x := range disks {
			t := x.e.facts.table
			if x.snap != 0 {
				t = x.e.facts.snaps[x.snap-1].table
			}
			name := partsName(names[x])
			if t == nil || !usable(name, taken) {
				continue
			}
			out[name] = &shown{e: x.e, snap: x.snap, part: partsFolder, size: x.size, table: t}
		}
	}
	// The folders of bitmap views, of images only (bitmaps.go).
	for _, x := range images {
		name := bitmapsName(names[x])
		if len(x.e.facts.bitmaps) == 0 || !usable(name, taken) {
			continue
		}
		out[name] = &shown{e: x.e, part: bitmapsFolder, size: x.size}
	}
	return out
}
