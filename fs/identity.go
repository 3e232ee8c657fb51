package fs

import (
	"fmt"
	"hash/fnv"
	"math/bits"
	"sync"
	"syscall"
)

// File identity: which node stands for which source file, and when a file
// counts as a different one.
//
// A source file is its (device, inode). What the mount shows of it is tied
// to a generation, an internal number that changes only when someone else
// changes the file while the mount has none of its files open: qemu wrote
// it, took a snapshot, resized it, converted over it. A new generation is a
// new node (go-fuse tells nodes apart by inode number and generation), so
// everything cached about the old content goes with the old node: the
// kernel's page cache and attributes, the open image's tables and hole
// index, the partition table, the counted data bytes. The mount's own
// writes, made through open files, never change the generation: a file
// changed while we held it open is a file we changed.
//
// A node can also go bad while its file stays the same: a page-cache write
// past the end of a disk made the kernel's size of the node too large, and
// the kernel keeps that size while its inode lives (writeback.go). Such a
// disk (or partition) is replaced: later lookups of its name get a new
// node (nodeGen), with the disk's size, and the files open on the old one
// go on with it until they close.

// fileKey identifies a source file.
type fileKey struct{ dev, ino uint64 }

func keyOf(st *syscall.Stat_t) fileKey { return fileKey{dev: st.Dev, ino: st.Ino} }

// version is what changes when a file's content may have changed.
type version struct {
	size         int64
	mtime, ctime int64 // nanoseconds
}

func versionOf(st *syscall.Stat_t) version {
	return version{size: st.Size, mtime: st.Mtim.Nano(), ctime: st.Ctim.Nano()}
}

// inode is the inode number shown for the file: the host inode number with
// the device mixed into the bits that host inode numbers rarely reach, so
// files of different file systems under the source rarely collide.
func (k fileKey) inode() uint64 { return k.ino ^ bits.RotateLeft64(k.dev, 40) }

// fileState is what the mount remembers of one source file.
type fileState struct {
	gen     uint64  // current generation
	known   version // the version the current generation stands for
	handles int     // open FUSE handles on any disk of the file
	closed  uint64  // identities.clock when a handle last closed
}

// identities tracks generations. mu guards files, next, clock and
// replaced; no I/O is done under it.
type identities struct {
	mu       sync.Mutex
	files    map[fileKey]*fileState
	next     uint64
	clock    uint64            // handles closed so far, of any file
	replaced map[diskID]uint64 // how often each disk's node was replaced
}

// maxIdentities bounds the table: files without open handles are forgotten
// when it is full (their next generation is then a fresh number, which is
// always safe: a new node).
const maxIdentities = 1 << 16

func newIdentities() *identities {
	return &identities{files: map[fileKey]*fileState{}, replaced: map[diskID]uint64{}}
}

// now is the time to pass to observe (or opened) for a stat taken after
// this call.
func (t *identities) now() uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.clock
}

// observe returns the generation of the file k seen at version v, which
// a stat taken after now() returned since gave: the current one if v is
// the version it stands for, or if the mount has the file open (then v is
// our own doing), or if a handle closed since (then v may be a stat of
// our own writes in progress, older than the version the close recorded:
// no evidence of another writer; the entry's next stat tells); else a new
// one.
func (t *identities) observe(k fileKey, v version, since uint64) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := t.files[k]
	if s == nil {
		if len(t.files) >= maxIdentities {
			for fk, fs := range t.files {
				if fs.handles == 0 {
					delete(t.files, fk)
				}
			}
		}
		t.next++
		s = &fileState{gen: t.next, known: v}
		t.files[k] = s
		return s.gen
	}
	switch {
	case s.known == v:
	case s.handles > 0:
		s.known = v
	case s.closed > since:
	default:
		t.next++
		s.gen, s.known = t.next, v
	}
	return s.gen
}

// opened counts an open handle of generation gen of file k, seen at
// version v (a stat taken after since). It fails (ESTALE: the kernel then
// looks the name up again) if the file changed into another generation.
func (t *identities) opened(k fileKey, gen uint64, v version, since uint64) error {
	if t.observe(k, v, since) != gen {
		return syscall.ESTALE
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if s := t.files[k]; s != nil && s.gen == gen {
		s.handles++
		return nil
	}
	return syscall.ESTALE
}

// busy counts a close of an image of file k by the mount (the writes it
// makes are the mount's) as an open handle, which closed ends; it reports
// whether it counted one.
func (t *identities) busy(k fileKey) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if s := t.files[k]; s != nil {
		s.handles++
		return true
	}
	return false
}

// closed drops an open handle of file k; v is the file's version now,
// which the current generation then stands for (our writes changed it).
func (t *identities) closed(k fileKey, v version) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.clock++
	if s := t.files[k]; s != nil {
		s.handles--
		s.known, s.closed = v, t.clock
	}
}

// replace makes later lookups of disk d get a new node.
func (t *identities) replace(d diskID) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.replaced) >= maxIdentities {
		clear(t.replaced)
	}
	t.replaced[d]++
}

// replacements is how often disk d's node was replaced.
func (t *identities) replacements(d diskID) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.replaced[d]
}

// nodeGen is the generation of the node that shows x: the shown entry's
// (shown.gen), another each time the disk's node was replaced.
func (m *mount) nodeGen(x *shown) uint64 {
	return x.gen() ^ m.ids.replacements(x.disk())*0xbf58476d1ce4e5b9 | 1
}

// diskID names a disk the mount shows: one generation of an image file, or
// one internal snapshot of it, or a partition of either.
type diskID struct {
	key fileKey
	gen uint64
	// snap is 1 + the index of a snapshot in the image's snapshot table;
	// 0 for the image's current state. (Not the snapshot ID: IDs can
	// repeat in a hostile table, table entries cannot.)
	snap int
	// part is a partition number of the disk (parts.go): 0 for the
	// whole disk, partsFolder for the folder of its partitions,
	// bitmapsFolder for the folder of its bitmap views (bitmaps.go).
	part int
}

const (
	partsFolder   = -1
	bitmapsFolder = -2
)

// base is the whole disk d is part of.
func (d diskID) base() diskID { return diskID{key: d.key, gen: d.gen, snap: d.snap} }

// inode is the disk's inode number: the image file's for the image
// itself; for a snapshot, a partition or a partitions or bitmaps folder, a hash of
// the file, snapshot and partition with the top bit set, a range host
// inode numbers do not reach.
func (d diskID) inode() uint64 {
	if d.snap == 0 && d.part == 0 {
		return d.key.inode()
	}
	h := fnv.New64a()
	fmt.Fprintf(h, "%d/%d/%d/%d", d.key.dev, d.key.ino, d.snap, d.part)
	return h.Sum64() | 1<<63
}
