package qcow2

import "fmt"

// Dirty metadata and its ordered write-back (crosvm's sync_caches, qemu's
// qcow2_cache_flush with its dependencies), and what happens to freed
// clusters.
//
// Changes to L2 tables, refcount blocks, the refcount table and the L1
// table are made in memory (readers see them at once) and written back by
// flushLocked, in this order, each step durable before the next starts:
//
//  1. guest data and copy-on-write data (already written), refcount
//     blocks: written, then synced with the data, so a new cluster's
//     refcount and contents are on disk before anything points to it;
//  2. the refcount table's new entries, synced: a block is on disk before
//     the table names it;
//  3. L2 tables, synced: an L2 entry names only clusters whose refcount
//     and data are durable;
//  4. L1 entries, synced: an L1 entry names only durable L2 tables;
//  5. only then the references the flush removed (a discarded cluster, a
//     compressed or shared cluster replaced by a copy, an L2 table
//     replaced by its copy) are gone from disk, and their refcounts drop
//     (freeing). A cluster whose refcount reaches zero is reused only once
//     no request that could still map it is left (pins.go): stricter than
//     qemu, which reuses at once, so that after a crash no guest offset can
//     read another offset's data.
//
// A crash between any two writes leaves at worst clusters whose refcount
// is higher than their references (leaks), never the reverse.

// maxDirtyBytes is the most table data the writer keeps dirty (pinned in
// the cache) before it writes back on its own.
const maxDirtyBytes = 8 << 20

// freeing is a reference the writer removed in memory: once that removal
// is durable, the refcounts of clusters [first, first+n) drop by one.
type freeing struct {
	first, n int64
}

// quarantined is a cluster whose last reference is gone and durable, whose
// refcount drops to zero once no pin of epoch tag is left.
type quarantined struct {
	c   int64
	tag uint64
}

// dirtyTable returns the cached table at off (an L2 table or a refcount
// block of the image file), pinned and recorded as dirty, for the writer
// to change. load reads it on a miss.
func (w *writer) dirtyTable(off int64, what string) (*table, error) {
	l := w.l
	if e := w.dirtyTables[off]; e != nil {
		return e.table, nil
	}
	e, err := l.cache.pin(cacheKey{owner: l.owner, off: off}, func() ([]uint64, error) {
		return l.meta.table(off, what)
	})
	if err != nil {
		return nil, err
	}
	w.dirtyTables[off] = e
	w.dirtyBytes += e.bytes()
	return e.table, nil
}

// markDirty records a table the writer put into the cache itself (pinned
// by Cache.put) as dirty.
func (w *writer) markDirty(e *cacheEntry) {
	if w.dirtyTables[e.key.off] != nil {
		w.l.cache.unpin(e)
		return
	}
	w.dirtyTables[e.key.off] = e
	w.dirtyBytes += e.bytes()
}

// dirtyL1 records that L1 entry i changed.
func (w *writer) dirtyL1(i int64) {
	if !w.l1Dirty {
		w.l1Lo, w.l1Hi, w.l1Dirty = i, i+1, true
		return
	}
	w.l1Lo, w.l1Hi = min(w.l1Lo, i), max(w.l1Hi, i+1)
}

// Flush makes everything written to the image so far durable: fsync.
func (img *Image) Flush() error {
	w := img.w
	if w == nil {
		return nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.flushLocked()
}

// flushLocked writes dirty metadata back in the order above, then lets the
// removed references' clusters go. A failure sticks (writer.fail).
func (w *writer) flushLocked() error {
	if err := w.usable(); err != nil {
		return err
	}
	w.st.flushes.Add(1)
	var l2s, blocks []*cacheEntry
	for _, e := range w.dirtyTables {
		if w.isRefblock(e.key.off) {
			blocks = append(blocks, e)
		} else {
			l2s = append(l2s, e)
		}
	}
	// 1. Refcount blocks, then sync with the data.
	for _, e := range blocks {
		if err := w.writeTable(e, MetaRefcountBlock); err != nil {
			return w.fail(err)
		}
	}
	if err := w.syncAll(); err != nil {
		return err
	}
	// 2. The refcount table's new entries.
	if w.reft.dirtyLo < w.reft.dirtyHi {
		if err := w.writeWords(w.reft, w.reftOff, MetaRefcountTable); err != nil {
			return w.fail(err)
		}
		if err := w.sync(); err != nil {
			return err
		}
	}
	// 3. L2 tables.
	if len(l2s) > 0 {
		for _, e := range l2s {
			if err := w.writeTable(e, MetaL2, MetaSnapshotL2); err != nil {
				return w.fail(err)
			}
		}
		if err := w.sync(); err != nil {
			return err
		}
	}
	// 4. L1 entries.
	if w.l1Dirty {
		t := w.l.l1.Load()
		buf := make([]byte, (w.l1Hi-w.l1Lo)*8)
		for i := w.l1Lo; i < w.l1Hi; i++ {
			putWord(buf[(i-w.l1Lo)*8:], uint64(t.entry(i)))
		}
		if err := w.writeMeta(buf, t.off+w.l1Lo*8, MetaL1); err != nil {
			return w.fail(err)
		}
		if err := w.sync(); err != nil {
			return err
		}
		w.l1Dirty = false
	}
	for _, e := range w.dirtyTables {
		w.l.cache.unpin(e)
	}
	clear(w.dirtyTables)
	w.dirtyBytes = 0
	// 5. The removed references are durably gone.
	if err := w.releaseFreed(); err != nil {
		return err
	}
	return nil
}

// releaseFreed drops the refcounts of the references the last flush made
// durably gone. A cluster still referenced elsewhere (a snapshot) just
// counts one less; one whose last reference went is quarantined.
func (w *writer) releaseFreed() error {
	pending := w.pendingFree
	w.pendingFree = nil
	tag := w.img.pins.epoch.Load()
	for _, f := range pending {
		for c := f.first; c < f.first+f.n; c++ {
			rc, err := w.refcountAt(c)
			if err != nil {
				return w.fail(err)
			}
			switch {
			case rc == 0:
				// Corrupt (a reference without a refcount):
				// nothing to drop.
			case rc == 1:
				w.quarantine = append(w.quarantine, quarantined{c: c, tag: tag})
			default:
				if err := w.setRefcount(c, rc-1); err != nil {
					return w.fail(err)
				}
			}
		}
	}
	return w.reclaim()
}

// reclaim frees the quarantined clusters no pin can see any more: their
// refcount drops to zero, their host range is punched (so it reads zeros),
// and the allocator may use them again.
func (w *writer) reclaim() error {
	cs := w.l.clusterSize()
	epoch := w.img.pins.settle()
	keep := w.quarantine[:0]
	for _, q := range w.quarantine {
		if epoch < q.tag+2 {
			keep = append(keep, q)
			continue
		}
		if err := w.setRefcount(q.c, 0); err != nil {
			return w.fail(err)
		}
		w.freeHint = min(w.freeHint, q.c)
		switch err := w.f.Punch(q.c*cs, cs); {
		case err == nil:
			// It reads zeros now: copy-on-write may skip zeros in it.
			w.markZeroed(q.c)
		case !unsupported(err):
			return w.fail(err)
		}
		// (Without punch support it keeps its old bytes, and
		// copy-on-write writes its zeros.)
	}
	w.quarantine = keep
	return nil
}

// markZeroed records that cluster c reads zeros on the host.
func (w *writer) markZeroed(c int64) {
	if w.zeroed == nil {
		w.zeroed = map[int64]bool{}
	}
	if len(w.zeroed) < 1<<16 {
		w.zeroed[c] = true
	}
}

// decref removes one reference to cluster c now: for references whose
// removal is already durable (an old refcount table).
func (w *writer) decref(c int64) error {
	rc, err := w.refcountAt(c)
	if err != nil || rc == 0 {
		return err
	}
	if rc == 1 {
		w.quarantine = append(w.quarantine, quarantined{c: c, tag: w.img.pins.epoch.Load()})
		return nil
	}
	return w.setRefcount(c, rc-1)
}

// free schedules dropping one reference to clusters [first, first+n)
// once the removal of that reference (made in memory by the caller) is
// durable.
func (w *writer) free(first, n int64) {
	if k := len(w.pendingFree); k > 0 && w.pendingFree[k-1].first+w.pendingFree[k-1].n == first {
		w.pendingFree[k-1].n += n
		return
	}
	w.pendingFree = append(w.pendingFree, freeing{first, n})
}

// isRefblock reports whether off is one of the refcount blocks.
func (w *writer) isRefblock(off int64) bool {
	m := w.l.metaMap.Load()
	r, ok := m.Overlap(off, off+1)
	return ok && r.Kind == MetaRefcountBlock
}

// writeTable writes the dirty part of a cached table back to its cluster,
// whole sectors at a time.
func (w *writer) writeTable(e *cacheEntry, kinds ...MetaKind) error {
	if err := w.writeWords(e.table, e.key.off, kinds...); err != nil {
		return err
	}
	w.st.tablesFlushed.Add(1)
	return nil
}

// writeWords writes words [dirtyLo, dirtyHi) of t, rounded out to whole
// 512-byte sectors, to the table at off, and marks t clean.
func (w *writer) writeWords(t *table, off int64, kinds ...MetaKind) error {
	if t.dirtyLo >= t.dirtyHi {
		return nil
	}
	lo := t.dirtyLo &^ 63 // 64 words to a sector
	hi := min((t.dirtyHi+63)&^63, len(t.words))
	buf := w.tableBuf(hi - lo)
	for i := lo; i < hi; i++ {
		putWord(buf[(i-lo)*8:], t.word(int64(i)))
	}
	if err := w.writeMeta(buf, off+int64(lo)*8, kinds...); err != nil {
		return err
	}
	t.dirtyLo, t.dirtyHi = 0, 0
	return nil
}

// tableBuf returns a buffer of n words' bytes, reused between writes.
func (w *writer) tableBuf(n int) []byte {
	if cap(w.buf) < n*8 {
		w.buf = make([]byte, n*8)
	}
	return w.buf[:n*8]
}

// writeMeta writes metadata of one of the given kinds at off, after
// checking that the range holds only metadata of those kinds (a free
// cluster becoming one is added to the map before it is written).
func (w *writer) writeMeta(b []byte, off int64, kinds ...MetaKind) error {
	if err := w.checkOverlap(off, int64(len(b)), kinds...); err != nil {
		return err
	}
	if _, err := w.f.WriteAt(b, off); err != nil {
		return w.fail(err)
	}
	return nil
}

// writeData writes guest data (or copy-on-write data) at host offset off
// of the data file, after checking that it is no metadata. pin is the
// caller's, held since it found off; a write left in flight (behind.go)
// holds a pin of its own until it lands.
func (w *writer) writeData(b []byte, off int64, pin Pin) error {
	if w.df == w.f {
		if err := w.checkOverlap(off, int64(len(b))); err != nil {
			return err
		}
	}
	if w.writeBehind(b, off, pin) {
		return nil
	}
	w.behind.wait(off, off+int64(len(b)))
	if _, err := w.df.WriteAt(b, off); err != nil {
		return w.fail(err)
	}
	if len(b) >= writebackMin {
		if wb, ok := w.df.(writebacker); ok {
			// Advisory: a failure shows at the next fdatasync.
			_ = wb.StartWriteback(off, int64(len(b)))
		}
	}
	return nil
}

// writebackMin is the smallest data write whose range is handed to the
// disk at once (writebacker). Below it the kernel's own writeback, which
// merges small writes, does better; at and above it a guest streams data
// (a 1 MiB dd, a file copy inside the guest), and starting the disk early
// is what the guest's O_DIRECT or fsync would wait for anyway.
const writebackMin = 256 << 10

// checkOverlap fails, marks the image corrupt (as qemu does) and stops all
// writes if [off, off+n) of the image file holds metadata of a kind other
// than allowed.
func (w *writer) checkOverlap(off, n int64, allowed ...MetaKind) error {
	m := w.l.metaMap.Load()
	r, bad := m.conflict(off, off+n, allowed...)
	if !bad {
		return nil
	}
	err := &FormatError{File: w.l.name, Field: "host offset", Value: uint64(off), Offset: -1,
		Msg: fmt.Sprintf("a write of %d bytes would overwrite the %s at %#x: the image is corrupt; it is marked so and no longer written", n, r.Kind, r.Start)}
	w.markCorrupt(err)
	return fmt.Errorf("%w: %w", ErrOverlap, err)
}

// markCorrupt sets the header's corrupt bit, as qemu does on an overlap,
// and stops every later write.
func (w *writer) markCorrupt(why error) {
	if !w.corrupt.CompareAndSwap(nil, &why) {
		return
	}
	// Best effort: the image is refused from now on whatever the header
	// says, and a failed write here changes nothing else.
	_ = w.updateHeader(func(h []byte) {
		fieldIncompatibleFeatures.put(h, fieldIncompatibleFeatures.get(h)|IncompatCorrupt)
	})
}

// sync makes what was written to the image file durable.
func (w *writer) sync() error {
	w.st.syncs.Add(1)
	if err := w.f.Sync(); err != nil {
		return w.fail(err)
	}
	return nil
}

// syncAll syncs the data file too, if there is one, once the data
// writes in flight have landed.
func (w *writer) syncAll() error {
	w.behind.drain()
	if err := w.usable(); err != nil {
		return err
	}
	if w.df != w.f {
		w.st.syncs.Add(1)
		if err := w.df.Sync(); err != nil {
			return w.fail(err)
		}
	}
	return w.sync()
}

// updateHeader changes fields of the header's first sector and writes it
// with one synced write: every field the writer switches (L1 table,
// refcount table, size, features) lies in it, so each switch is atomic.
// change gets the header as it is now, never a copy taken before an
// allocation that may have switched a table meanwhile (a resize whose L1
// allocation grew the refcount table must not put the old table back).
// Header writes are serialised by hdrMu, which markCorrupt takes too.
func (w *writer) updateHeader(change func(h []byte)) error {
	w.hdrMu.Lock()
	defer w.hdrMu.Unlock()
	h := w.hdrBuf[:len(w.hdr0)]
	copy(h, w.hdr0)
	change(h)
	if _, err := w.f.WriteAt(h, 0); err != nil {
		return w.fail(err)
	}
	w.st.syncs.Add(1)
	if err := w.f.Sync(); err != nil {
		return w.fail(err)
	}
	copy(w.hdr0, h)
	return nil
}

// headerField returns a field of the header as last written.
func (w *writer) headerField(f headerField) uint64 {
	w.hdrMu.Lock()
	defer w.hdrMu.Unlock()
	return f.get(w.hdr0)
}

// addMeta records new metadata in the map, before it is written.
func (w *writer) addMeta(off, n int64, k MetaKind) error {
	m := w.l.metaMap.Load()
	if r, bad := m.conflict(off, off+n); bad {
		err := &FormatError{File: w.l.name, Field: "host offset", Value: uint64(off), Offset: -1,
			Msg: fmt.Sprintf("a new %s would overlap the %s at %#x: the image is corrupt; it is marked so and no longer written", k, r.Kind, r.Start)}
		w.markCorrupt(err)
		return fmt.Errorf("%w: %w", ErrOverlap, err)
	}
	w.l.metaMap.Store(m.with(off, off+n, k))
	return nil
}

func putWord(b []byte, v uint64) {
	_ = b[7]
	b[0], b[1], b[2], b[3] = byte(v>>56), byte(v>>48), byte(v>>40), byte(v>>32)
	b[4], b[5], b[6], b[7] = byte(v>>24), byte(v>>16), byte(v>>8), byte(v)
}
