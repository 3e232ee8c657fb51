package qcow2

import (
	"encoding/binary"
	"fmt"
	"math/bits"
	"sync/atomic"
)

// Keeping persistent dirty bitmaps true while the image is written, by
// qemu's protocol (specification, "Bitmaps"; qemu's qcow2-bitmap.c):
//
//  1. Before the first write, every enabled bitmap (flag "auto") is marked
//     in_use in the bitmap directory, durably (start). From then on, until
//     the image is closed cleanly, qemu and qemu-img treat it as
//     inconsistent: a crash can never leave a bitmap that looks valid but
//     misses a write.
//  2. Every write, zero-write and discard sets the bits of the granules it
//     touches, in memory, before it returns (mark).
//  3. At every flush the bitmaps' changed data clusters are written (in
//     place, or to clusters allocated for them), before the refcount
//     blocks and their sync, and the changed table entries after it, with
//     the L2 tables (store, called by flushLocked).
//  4. At a clean close, after the last flush, in_use is cleared again.
//
// Disabled bitmaps are left as they are, but grow with the disk (their
// tables must cover it, as qemu's check_dir_entry demands). Bitmaps found
// in_use at open, or an extension without its autoclear bit, make the
// image read-only (readOnlyReason).
//
// A bitmap's data is one bit per granule of the disk, least significant
// bit first, each data cluster holding cluster_size*8 granules; a table
// entry is the cluster's offset, or 0 (all zeros) or 1 (all ones) with no
// cluster.

// trackedBitmap is an enabled bitmap the writer keeps true.
type trackedBitmap struct {
	entry *bitmapEntry
	table []uint64 // its bitmap table, as on disk
	// bits are its bits, granule by granule: replaced (under w.mu) when
	// the disk grows, read without w.mu by live views (bitmapview.go).
	bits    atomic.Pointer[[]atomic.Uint64]
	changed []atomic.Uint64 // one bit per table entry changed since the last store
	tableLo int             // the table's dirty entries [tableLo, tableHi)
	tableHi int
}

// bitmapState is the writer's bitmaps, guarded by w.mu (the bits are
// atomic: views read them without it).
type bitmapState struct {
	dir     []bitmapEntry
	tracked []*trackedBitmap
	inUse   bool // in_use set on disk, by this writer
	charged int64
}

// openBitmaps loads the enabled bitmaps of an image opened for writing.
func (w *writer) openBitmaps() error {
	l := w.l
	if !l.bitmapsUsed() {
		return nil
	}
	dir, err := l.readBitmapDirectory()
	if err != nil {
		return err
	}
	w.bitmaps.dir = dir
	for i := range dir {
		e := &dir[i]
		if e.flags&bitmapAuto == 0 {
			continue
		}
		tb, err := w.loadBitmap(e)
		if err != nil {
			return err
		}
		w.bitmaps.tracked = append(w.bitmaps.tracked, tb)
	}
	return nil
}

// bitmapWords is how many 64-bit words a bitmap of granularity 2^g holds
// for a disk of size bytes.
func bitmapWords(size int64, g uint8) int64 {
	granules := (size + 1<<g - 1) >> g
	return (granules + 63) / 64
}

// loadBitmap reads bitmap e's table and data into memory, charged to the
// budget.
func (w *writer) loadBitmap(e *bitmapEntry) (*trackedBitmap, error) {
	l := w.l
	cs := l.clusterSize()
	table, err := l.readBitmapTable(e)
	if err != nil {
		return nil, err
	}
	n := bitmapWords(l.vsize(), e.granBits)
	perCluster := cs / 8 // words per data cluster
	n = max(n, int64(len(table))*perCluster)
	w.bitmaps.charged += int64(len(table)) * 8 // (readBitmapTable charged it)
	if err := l.budget.add(n*8, fmt.Sprintf("bitmap %q", e.name)); err != nil {
		return nil, err
	}
	w.bitmaps.charged += n * 8
	all := make([]atomic.Uint64, n)
	tb := &trackedBitmap{entry: e, table: table, changed: make([]atomic.Uint64, (len(table)+63)/64)}
	tb.bits.Store(&all)
	if err := l.readBitmapWords(e, table, all); err != nil {
		return nil, err
	}
	return tb, nil
}

// setInUse writes the in_use flag of every tracked bitmap into the
// directory and syncs it (or clears it): before the first write, and at a
// clean close. The caller holds w.mu.
func (w *writer) setInUse(on bool) error {
	bs := &w.bitmaps
	if len(bs.tracked) == 0 || bs.inUse == on {
		return nil
	}
	var b [4]byte
	for _, tb := range bs.tracked {
		f := tb.entry.flags &^ bitmapInUse
		if on {
			f |= bitmapInUse
		}
		binary.BigEndian.PutUint32(b[:], f)
		if err := w.host.writeMeta(b[:], tb.entry.off+12, MetaBitmapDirectory); err != nil {
			return err
		}
		tb.entry.flags = f
	}
	if err := w.host.sync(); err != nil {
		return err
	}
	bs.inUse = on
	return nil
}

// mark sets the bits of every tracked bitmap for guest range [off,
// off+n). The caller holds w.mu (start).
func (w *writer) mark(off, n int64) {
	if n <= 0 {
		return
	}
	cs := w.l.clusterSize()
	for _, tb := range w.bitmaps.tracked {
		words := *tb.bits.Load()
		g := tb.entry.granBits
		first, last := off>>g, (off+n-1)>>g
		for i := first; i <= last; {
			word := i / 64
			if word >= int64(len(words)) {
				break
			}
			hi := min(last, word*64+63)
			mask := ^uint64(0) >> (63 - (hi - word*64)) &^ (uint64(1)<<(i-word*64) - 1)
			if words[word].Load()&mask != mask {
				words[word].Or(mask)
				j := word * 8 / cs // the table entry of this word
				tb.changed[j/64].Or(1 << (j % 64))
			}
			i = hi + 1
		}
	}
}

// storeBitmaps writes the changed data clusters of the tracked bitmaps,
// allocating those that had none; the table entries it changes are written
// by writeBitmapTables after the refcount blocks. The caller holds w.mu.
func (w *writer) storeBitmaps() error {
	cs := w.l.clusterSize()
	perCluster := cs / 8
	var buf []byte
	for _, tb := range w.bitmaps.tracked {
		words := *tb.bits.Load()
		for k := range tb.changed {
			pending := tb.changed[k].Swap(0)
			for pending != 0 {
				j := k*64 + bits.TrailingZeros64(pending)
				pending &= pending - 1
				if buf == nil {
					buf = make([]byte, cs)
				}
				zeros, ones := true, true
				for i := range perCluster {
					v := words[int64(j)*perCluster+i].Load()
					binary.LittleEndian.PutUint64(buf[8*i:], v)
					zeros, ones = zeros && v == 0, ones && v == ^uint64(0)
				}
				te := tb.table[j]
				off := int64(te & bitmapEntryMask)
				switch {
				case off == 0 && (zeros && te == 0 || ones && te&1 != 0):
					continue // the entry says it already
				case off == 0:
					var err error
					if off, err = w.alloc.allocateOne(); err != nil {
						return err
					}
					if err := w.host.addMeta(off, cs, MetaBitmapData); err != nil {
						return err
					}
					tb.table[j] = uint64(off)
					tb.dirtyTable(j)
				}
				if err := w.host.writeMeta(buf, off, MetaBitmapData); err != nil {
					return w.host.fail(err)
				}
			}
		}
	}
	return nil
}

func (tb *trackedBitmap) dirtyTable(j int) {
	if tb.tableLo >= tb.tableHi {
		tb.tableLo, tb.tableHi = j, j+1
		return
	}
	tb.tableLo, tb.tableHi = min(tb.tableLo, j), max(tb.tableHi, j+1)
}

// writeBitmapTables writes the changed entries of the bitmap tables, and
// says whether there were any. The caller holds w.mu, after the refcounts
// of the clusters they name are durable.
func (w *writer) writeBitmapTables() (bool, error) {
	wrote := false
	for _, tb := range w.bitmaps.tracked {
		if tb.tableLo >= tb.tableHi {
			continue
		}
		wrote = true
		b := make([]byte, (tb.tableHi-tb.tableLo)*8)
		for i := tb.tableLo; i < tb.tableHi; i++ {
			putWord(b[(i-tb.tableLo)*8:], tb.table[i])
		}
		if err := w.host.writeMeta(b, int64(tb.entry.tableOffset)+int64(tb.tableLo)*8, MetaBitmapTable); err != nil {
			return true, w.host.fail(err)
		}
		tb.tableLo, tb.tableHi = 0, 0
	}
	return wrote, nil
}

// growBitmaps makes every bitmap's table cover a disk of size bytes (a
// resize): the tracked bitmaps' bits grow (the new granules clean, as
// qemu grows them), and a table too small gets the room its clusters have
// left, or a larger table elsewhere, switched in the directory with a
// synced write before the old one is freed. The caller holds w.mu, after
// a flush.
func (w *writer) growBitmaps(size int64) error {
	cs := w.l.clusterSize()
	for i := range w.bitmaps.dir {
		e := &w.bitmaps.dir[i]
		need := (bitmapWords(size, e.granBits)*8 + cs - 1) / cs
		if need <= int64(e.tableSize) {
			continue
		}
		if err := w.growBitmapTable(e, need); err != nil {
			return err
		}
		for _, tb := range w.bitmaps.tracked {
			if tb.entry == e {
				more := (need - int64(len(tb.table))) * (cs + 8) // bits and table
				if err := w.l.budget.add(more, fmt.Sprintf("bitmap %q", e.name)); err != nil {
					return err
				}
				w.bitmaps.charged += more
				tb.table = append(tb.table, make([]uint64, need-int64(len(tb.table)))...)
				words, old := make([]atomic.Uint64, need*cs/8), *tb.bits.Load()
				for k := range old {
					words[k].Store(old[k].Load())
				}
				tb.bits.Store(&words)
				changed := make([]atomic.Uint64, (need+63)/64)
				for k := range tb.changed {
					changed[k].Store(tb.changed[k].Load())
				}
				tb.changed = changed
			}
		}
	}
	return nil
}

// growBitmapTable gives bitmap e a table of need entries (the new ones
// zero: no data, all clean): in its own clusters if they have room (the
// new entries zeroed and synced before the directory says the new size),
// else in a new table written past the clusters in use, its refcounts
// durable with the refcount table entries naming new blocks
// (persistRefcounts), then the directory entry switched with a synced
// write, and only then the old table given back.
func (w *writer) growBitmapTable(e *bitmapEntry, need int64) error {
	cs := w.l.clusterSize()
	oldOff, oldN := int64(e.tableOffset), int64(e.tableSize)
	oldBytes := (oldN*8 + cs - 1) / cs * cs
	b := make([]byte, need*8)
	if need*8 <= oldBytes {
		// Room in its clusters: zero the new entries, then say so.
		if err := w.host.writeMeta(b[oldN*8:], oldOff+oldN*8, MetaBitmapTable); err != nil {
			return w.host.fail(err)
		}
		if err := w.host.sync(); err != nil {
			return err
		}
		return w.writeBitmapEntry(e, oldOff, need)
	}
	if err := w.frees.tableReleasable(oldOff, oldBytes, MetaBitmapTable); err != nil {
		return err
	}
	old := make([]byte, oldN*8)
	if err := w.l.meta.read(old, oldOff, "bitmap table"); err != nil {
		return err
	}
	copy(b, old)
	for _, tb := range w.bitmaps.tracked {
		if tb.entry == e {
			for j, te := range tb.table {
				putWord(b[j*8:], te)
			}
			tb.tableLo, tb.tableHi = 0, 0
		}
	}
	clusters := (need*8 + cs - 1) / cs
	off, err := w.alloc.allocateTable(clusters)
	if err != nil {
		return err
	}
	if err := w.host.addMeta(off, clusters*cs, MetaBitmapTable); err != nil {
		return err
	}
	if err := w.host.writeMeta(b, off, MetaBitmapTable); err != nil {
		return w.host.fail(err)
	}
	if err := w.persistRefcounts(); err != nil {
		return err
	}
	if err := w.writeBitmapEntry(e, off, need); err != nil {
		return err
	}
	return w.frees.releaseTable(oldOff, oldBytes, MetaBitmapTable)
}

// writeBitmapEntry switches bitmap e's directory entry to the table of n
// entries at off, with a synced write.
func (w *writer) writeBitmapEntry(e *bitmapEntry, off, n int64) error {
	var b [12]byte
	binary.BigEndian.PutUint64(b[:], uint64(off))
	binary.BigEndian.PutUint32(b[8:], uint32(n))
	if err := w.host.writeMeta(b[:], e.off, MetaBitmapDirectory); err != nil {
		return err
	}
	if err := w.host.sync(); err != nil {
		return err
	}
	e.tableOffset, e.tableSize = uint64(off), uint32(n)
	return nil
}

// closeBitmaps gives the bitmaps' memory back.
func (w *writer) closeBitmaps() {
	w.l.budget.sub(w.bitmaps.charged)
	w.bitmaps = bitmapState{}
}
