package qcow2

import (
	"fmt"
	"sync"
	"sync/atomic"
)

// The writer: an image opened for writing, and its parts.
//
// Only the top image of a chain is ever written; backing files stay
// read-only. An image that cannot be written safely opens read-only, and
// Image.ReadOnlyReason says why: qcowfs shows it read-only with that line.
//
// The writer is made of parts, each a type in its own file that holds its
// state and acts on it; the others go through its methods (its doors),
// never its fields:
//   - allocator (alloc.go): free clusters and their refcounts, refcount
//     blocks, new tables; handed an allocEnv (allocDoors below) for the
//     refcount blocks, the metadata map, file space and the refcount
//     table's growth.
//   - dirtySet (dirty.go): tables changed in memory and not yet written
//     back, and the walk the flush follows.
//   - freeLists (freeing.go): references whose removal waits for a
//     flush, clusters in quarantine until no pin (pin.go) can see them.
//   - hostDoor (hostwrite.go): the door to the host files: every write,
//     sync, punch and growth of them, checked against the metadata map;
//     the header; the files' sizes as the writer made them; whether a
//     write failed or found the image corrupt.
//   - guestHolds (write.go): the guest ranges of writes that change
//     metadata.
//
// The writer's own methods orchestrate them: write.go (WriteAt, Resize,
// in runs of guest clusters), zero.go (Discard, WriteZeroes),
// writemap.go and cow.go (planning and linking the clusters of a write,
// copy-on-write), flush.go (the ordered write-back), reftable.go (the
// refcount table's growth), bitmapwrite.go (persistent bitmaps);
// sectorlock.go, behind.go and direct.go hold reads and writes in
// flight.

// writer is the write side of an image opened for writing.
//
// mu guards every change to the top layer's metadata (its L1 and L2
// tables, refcount table and blocks, header) and the parts below that say
// so. Guest data is written without it: a write that needs metadata plans
// under mu, writes its data with only its guest clusters held (holds), and
// takes mu again to link the new clusters in.
type writer struct {
	img *Image
	l   *layer

	mu      sync.Mutex
	holds   guestHolds  // guest ranges of writes that change metadata (write.go)
	bitmaps bitmapState // persistent dirty bitmaps kept true (bitmapwrite.go)
	alloc   *allocator  // free clusters and refcounts (alloc.go)
	dirty   dirtySet    // tables changed and not yet written back (dirty.go)
	frees   freeLists   // references and clusters on their way out (freeing.go)
	host    *hostDoor   // every host write, sync, punch and growth; failed and corrupt (hostwrite.go)
	behind  *behind     // data writes in flight (behind.go)
	sectors *rangeLock  // guest ranges read, and written in place (sectorlock.go)
	rmw     *rangeLock  // encrypted images: sectors being rewritten (encrypt.go)

	headerCleaned bool // unknown autoclear bits cleared (once, at the first write)
	modified      bool // something was written since the image was opened

	st writeCounters
}

// writeCounters are the writer's counters, atomics so that writes outside
// mu count too.
type writeCounters struct {
	writes, inPlace, allocations, hostBytes, cowBytes, zeroSkipped, directBytes,
	flushes, syncs, tablesFlushed atomic.Int64
}

// readOnlyReason says why the top layer l cannot be written, or "".
func readOnlyReason(l *layer) string {
	h := l.hdr
	switch {
	case h.IncompatibleFeatures&IncompatCorrupt != 0:
		return "qemu marked it corrupt (repair it with qemu-img check -r all)"
	case h.IncompatibleFeatures&IncompatDirty != 0:
		return "it was not closed cleanly and its refcounts may be stale (repair it with qemu-img check -r all)"
	case h.CryptMethod == cryptAES:
		return "it is encrypted with qemu's legacy AES format, which qcowfs only reads, and qemu no longer writes either (qemu-img convert it to a LUKS-encrypted image to write it)"
	case h.HasBitmaps && h.Bitmaps.NbBitmaps > 0 && h.AutoclearFeatures&AutoclearBitmaps == 0:
		return "its persistent dirty bitmaps are marked invalid (autoclear bit 0 clear): a program that did not keep them wrote it (qemu-img check -r all drops them)"
	case h.RefcountTableClusters == 0:
		return "it has no refcount table"
	}
	if _, err := l.metadata(); err != nil {
		return fmt.Sprintf("its metadata cannot be mapped for overlap checks: %v", err)
	}
	if l.bitmapsUsed() {
		dir, err := l.readBitmapDirectory()
		if err != nil {
			return fmt.Sprintf("its bitmap directory cannot be read: %v", err)
		}
		for _, e := range dir {
			if e.flags&bitmapInUse != 0 {
				return fmt.Sprintf("its persistent bitmap %q is in use: a program writing it did not close it cleanly, so it may be inconsistent (remove it with qemu-img bitmap --remove, after a full backup)", e.name)
			}
		}
	}
	return ""
}

// openWriter prepares the top layer of img for writing: f is its image file
// opened for writing, df its data file (nil without one).
func openWriter(img *Image, f, df WritableFile) (*writer, error) {
	l := img.top
	w := &writer{img: img, l: l, behind: newBehind(), sectors: newRangeLock(), rmw: newRangeLock()}
	w.holds = newGuestHolds(&w.mu)
	rt, err := l.refcountTable()
	if err != nil {
		return nil, err
	}
	if w.host, err = newHostDoor(l, f, df, w.behind, &w.st); err != nil {
		return nil, err
	}
	w.dirty = newDirtySet(l, w.host)
	env := allocDoors{dirtySet: &w.dirty, hostDoor: w.host, w: w}
	w.alloc, err = newAllocator(env, l.name, l.clusterSize(), l.hdr.RefcountOrder, append([]uint64(nil), rt...), int64(l.hdr.RefcountTableOffset), &w.st.allocations)
	if err != nil {
		return nil, err
	}
	w.frees = freeLists{l: l, alloc: w.alloc, host: w.host, pins: &img.pins, behind: w.behind}
	if err := w.openBitmaps(); err != nil {
		w.closeBitmaps()
		return nil, err
	}
	return w, nil
}

// allocDoors is what the writer hands its allocator (allocEnv): the
// refcount blocks of the dirty set, the host door's metadata map and file
// space, and the writer's growth of the refcount table (reftable.go).
type allocDoors struct {
	*dirtySet
	*hostDoor
	w *writer
}

func (a allocDoors) growReftable(need int64) error { return a.w.growReftable(need) }

// WriteStats counts what the writer did, for tests and the daemon's status.
type WriteStats struct {
	Writes        int64 `json:"writes"`         // WriteAt calls
	InPlace       int64 `json:"in-place"`       // runs written in place, without metadata changes
	Allocations   int64 `json:"allocations"`    // host clusters allocated
	HostBytes     int64 `json:"host-bytes"`     // guest data and copy-on-write bytes written to the host
	CowBytes      int64 `json:"cow-bytes"`      // of them, copied from elsewhere
	ZeroSkipped   int64 `json:"zero-skipped"`   // copy-on-write bytes not written because they were zeros
	DirectBytes   int64 `json:"direct-bytes"`   // of the host bytes, written with O_DIRECT (direct.go)
	Flushes       int64 `json:"flushes"`        // metadata write-backs
	Syncs         int64 `json:"syncs"`          // fdatasync calls
	TablesFlushed int64 `json:"tables-flushed"` // L2 tables and refcount blocks written back
}

// WriteStats returns the writer's counters; the zero value for read-only
// images.
func (img *Image) WriteStats() WriteStats {
	w := img.w
	if w == nil {
		return WriteStats{}
	}
	c := &w.st
	return WriteStats{
		Writes: c.writes.Load(), InPlace: c.inPlace.Load(), Allocations: c.allocations.Load(),
		HostBytes: c.hostBytes.Load(), CowBytes: c.cowBytes.Load(), ZeroSkipped: c.zeroSkipped.Load(),
		DirectBytes: c.directBytes.Load(), Flushes: c.flushes.Load(), Syncs: c.syncs.Load(), TablesFlushed: c.tablesFlushed.Load(),
	}
}

// Writable reports whether the image is open for writing.
func (img *Image) Writable() bool { return img.w != nil }

// ReadOnlyReason says why an image opened with Options.Writable is
// read-only ("" if it is writable, or was not asked to be).
func (img *Image) ReadOnlyReason() string { return img.roReason }

// close writes everything back and leaves a clean image: dirty
// metadata flushed, freed clusters' refcounts dropped and flushed too, the
// file's growth ahead given back.
func (w *writer) close() error {
	w.behind.drain()
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.modified {
		return nil // never written: nothing to do, nothing to sync
	}
	// Whatever happens, the space taken ahead goes back: an image that
	// failed must not keep a full host file system full.
	defer func() { w.host.giveBack(w.alloc.countedEnd()) }()
	if err := w.host.usable(); err != nil {
		return err
	}
	for range 3 {
		if err := w.flushLocked(); err != nil {
			return err
		}
		if w.frees.empty() && w.dirty.empty() {
			break
		}
	}
	w.host.giveBack(w.alloc.countedEnd())
	if err := w.host.sync(); err != nil {
		return err
	}
	// Everything is stored: the bitmaps are consistent again.
	return w.setInUse(false)
}
