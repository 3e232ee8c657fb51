package qcow2

import (
	"fmt"
	"sync"
	"sync/atomic"
)

// Opening an image for writing, and the writer's state.
//
// Only the top image of a chain is ever written; backing files stay
// read-only. An image that cannot be written safely opens read-only, and
// Image.ReadOnlyReason says why: qcowfs shows it read-only with that line.
//
// The writer's rooms, each in a file of its own:
//   - alloc.go: the allocator (free clusters, refcounts, refcount blocks
//     and table growth, the file grown ahead).
//   - writemap.go: the write side of the cluster mapping: planning what a
//     guest range needs, owning L2 tables, linking new clusters.
//   - cow.go: copy-on-write of the parts of a cluster a write leaves.
//   - write.go: WriteAt, Discard, WriteZeroes, Resize.
//   - flush.go: dirty metadata and its ordered write-back, frees.
//   - pins.go: when a freed cluster may be reused.

// writer is the write side of an image opened for writing.
//
// mu guards every change to the top layer's metadata (its L1 and L2
// tables, refcount table and blocks, header) and every field below. Guest
// data is written without it: a write that needs metadata plans under mu,
// writes its data with only its guest clusters held (busy), and takes mu
// again to link the new clusters in.
type writer struct {
	img *Image
	l   *layer
	f   WritableFile // the image file
	df  WritableFile // where data clusters live: the external data file, or f

	mu sync.Mutex
	// busyCond waits for a guest range held by another write.
	busyCond *sync.Cond
	busy     []span     // guest ranges being written, by offset
	behind   *behind    // data writes in flight (behind.go)
	sectors  *rangeLock // guest ranges read, and written in place (sectorlock.go)

	reft          *table // the refcount table; its dirty range is written back
	reftOff       int64  // where it lies
	perBlock      int64  // refcount entries per refcount block
	refWidth      uint   // bits per refcount entry
	maxRef        uint64 // the largest refcount an entry holds
	end           int64  // first cluster index past every cluster in use (refcount > 0)
	zeroFrom      int64  // clusters at or past this index read zeros on the host
	freeHint      int64  // no free cluster below this index
	fileEnd       int64  // the image file's size as the writer made it
	dataEnd       int64  // the data file's size (external data files)
	dataZeroFrom  int64  // and its size at open, rounded up to a cluster
	dirtyTables   map[int64]dirtyEntry
	dirtyBytes    int64
	l1Dirty       bool
	l1Lo, l1Hi    int64 // dirty L1 entries [lo, hi)
	pendingFree   []freeing
	quarantine    []quarantined
	short         bool // the host ran short of space: the growth ahead is given back at flush
	headerCleaned bool // unknown autoclear bits cleared (once, at the first write)
	modified      bool // something was written since the image was opened

	hdrMu  sync.Mutex     // guards hdr0 and hdrBuf, serialises header writes (updateHeader)
	hdr0   []byte         // the header's first sector as written
	hdrBuf []byte         // where updateHeader assembles the next one
	buf    []byte         // tableBuf's
	zeroed map[int64]bool // freed clusters punched: they read zeros

	// failed is sticky: a host write or sync failed, and every later
	// flush fails. corrupt: an overlap was found, and no more writes are
	// made at all. Both are read without mu by in-place writes.
	failed  atomic.Pointer[error]
	corrupt atomic.Pointer[error]
	st      writeCounters
}

// writeCounters are the writer's counters, atomics so that writes outside
// mu count too.
type writeCounters struct {
	writes, inPlace, allocations, hostBytes, cowBytes, zeroSkipped, directBytes,
	flushes, syncs, tablesFlushed atomic.Int64
}

// span is a guest byte range [start, end).
type span struct{ start, end int64 }

// readOnlyReason says why the top layer l cannot be written, or "".
func readOnlyReason(l *layer) string {
	h := l.hdr
	switch {
	case h.IncompatibleFeatures&IncompatCorrupt != 0:
		return "qemu marked it corrupt (repair it with qemu-img check -r all)"
	case h.IncompatibleFeatures&IncompatDirty != 0:
		return "it was not closed cleanly and its refcounts may be stale (repair it with qemu-img check -r all)"
	case h.CryptMethod != cryptNone:
		return "it is encrypted"
	case h.HasBitmaps && h.Bitmaps.NbBitmaps > 0:
		return "it has persistent dirty bitmaps, which qcowfs does not keep up to date"
	case h.RefcountTableClusters == 0:
		return "it has no refcount table"
	}
	if _, err := l.metadata(); err != nil {
		return fmt.Sprintf("its metadata cannot be mapped for overlap checks: %v", err)
	}
	return ""
}

// openWriter prepares the top layer of img for writing: f is its image file
// opened for writing, df its data file (nil without one).
func openWriter(img *Image, f, df WritableFile) (*writer, error) {
	l := img.top
	w := &writer{img: img, l: l, f: f, df: f, dirtyTables: map[int64]dirtyEntry{}, behind: newBehind(), sectors: newRangeLock()}
	w.busyCond = sync.NewCond(&w.mu)
	if df != nil {
		w.df = df
		w.dataEnd = l.dataLen.Load()
		w.dataZeroFrom = (w.dataEnd + l.clusterSize() - 1) &^ (l.clusterSize() - 1)
	}
	rt, err := l.refcountTable()
	if err != nil {
		return nil, err
	}
	w.reft = &table{words: append([]uint64(nil), rt...)}
	w.reftOff = int64(l.hdr.RefcountTableOffset)
	w.hdr0, w.hdrBuf = make([]byte, 512), make([]byte, 512)
	if err := readFull(f, w.hdr0[:min(512, l.fsize())], 0, "header"); err != nil {
		return nil, err
	}
	w.refWidth = 1 << l.hdr.RefcountOrder
	w.perBlock = l.clusterSize() * 8 / int64(w.refWidth)
	w.maxRef = 1<<w.refWidth - 1
	if w.refWidth == 64 {
		w.maxRef = ^uint64(0)
	}
	cs := l.clusterSize()
	w.fileEnd = l.fsize()
	w.zeroFrom = (l.fsize() + cs - 1) / cs
	if err := w.findEnd(); err != nil {
		return nil, err
	}
	return w, nil
}

// usable fails if the image can take no more writes.
func (w *writer) usable() error {
	if e := w.corrupt.Load(); e != nil {
		return *e
	}
	if e := w.failed.Load(); e != nil {
		return *e
	}
	return nil
}

// fail records a host I/O error: it sticks, so that every later flush of
// the image fails too, and no acknowledged write is silently lost.
func (w *writer) fail(err error) error {
	sticky := fmt.Errorf("%s: an earlier write or sync failed, so writes since the last successful flush may be lost: %w", w.l.name, err)
	w.failed.CompareAndSwap(nil, &sticky)
	return err
}

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
