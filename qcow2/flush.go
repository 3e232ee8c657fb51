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

// dirtyEntry is a table the writer changed and has not written back: an
// L2 table or a refcount block.
type dirtyEntry struct {
	e    *cacheEntry
	kind MetaKind
}

// dirtyTable returns the cached table of the given kind at off (an L2
// table or a refcount block of the image file), pinned and recorded as
// dirty, for the writer to change. Its cluster must hold that kind of
// metadata only: an L1 entry naming the refcount table as an L2 table
// would otherwise have L2 entries written into it (checkOverlap marks the
// image corrupt instead).
func (w *writer) dirtyTable(off int64, kind MetaKind) (*table, error) {
	l := w.l
	if d, ok := w.dirtyTables[off]; ok {
		if d.kind != kind {
			return nil, w.checkOverlap(off, l.clusterSize(), Kinds(kind))
		}
		return d.e.table, nil
	}
	if err := w.checkOverlap(off, l.clusterSize(), Kinds(kind)); err != nil {
		return nil, err
	}
	e, err := l.cache.pin(cacheKey{owner: l.owner, off: off}, func() ([]uint64, error) {
		return l.meta.table(off, kind.String())
	})
	if err != nil {
		return nil, err
	}
	w.dirtyTables[off] = dirtyEntry{e, kind}
	w.dirtyBytes += e.bytes()
	return e.table, nil
}

// markDirty records a table of the given kind that the writer put into
// the cache itself (pinned by Cache.put) as dirty.
func (w *writer) markDirty(e *cacheEntry, kind MetaKind) {
	if _, ok := w.dirtyTables[e.key.off]; ok {
		w.l.cache.unpin(e)
		return
	}
	w.dirtyTables[e.key.off] = dirtyEntry{e, kind}
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
	for _, d := range w.dirtyTables {
		if d.kind == MetaRefcountBlock {
			blocks = append(blocks, d.e)
		} else {
			l2s = append(l2s, d.e)
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
			if err := w.writeTable(e, MetaL2); err != nil {
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
	for _, d := range w.dirtyTables {
		w.l.cache.unpin(d.e)
	}
	clear(w.dirtyTables)
	w.dirtyBytes = 0
	// 5. The removed references are durably gone.
	if err := w.releaseFreed(); err != nil {
		return err
	}
	if w.short {
		w.giveBack()
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
				// A reference without a refcount (free checked
				// when it was scheduled; a refcount block changed
				// since?): corrupt, and nothing is written.
				err := &FormatError{File: w.l.name, Field: "refcount", Value: 0, Offset: -1,
					Msg: fmt.Sprintf("cluster %#x was referenced but has refcount 0: the image is corrupt; it is marked so and no longer written", c*w.l.clusterSize())}
				w.markCorrupt(err)
				return err
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
		// A cluster that holds metadata is never punched, whatever
		// its refcount says.
		if err := w.checkClusters("punching", q.c*cs, cs, 0); err != nil {
			return err
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

// unallocate gives back the fresh clusters of plans that were never
// linked: nothing references them, so they are quarantined at once, once
// any write of theirs in flight has landed, and reused like freed ones.
func (w *writer) unallocate(plans []clusterPlan) {
	cs := w.l.clusterSize()
	tag := w.img.pins.epoch.Load()
	for _, pl := range plans {
		if pl.fresh {
			w.behind.wait(pl.host, pl.host+cs)
			w.quarantine = append(w.quarantine, quarantined{c: pl.host / cs, tag: tag})
		}
	}
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

// freeable checks that a reference to clusters [first, first+n), naming
// what kind says (see free), can be dropped: the clusters hold nothing
// else, and each has a refcount in a sound refcount block (one that is no
// other table too). A reference without a refcount, or whose refcount
// lives in another table, is corruption qemu-img check reports; dropping
// it would write a refcount into that table. Callers check before they
// change anything, so that a refused write or discard changes nothing.
func (w *writer) freeable(first, n int64, kind MetaKind) error {
	cs := w.l.clusterSize()
	allowed := MetaKinds(0)
	if kind == MetaL2 {
		allowed = Kinds(MetaL2, MetaSnapshotL2) // shared with a snapshot
	}
	if err := w.checkClusters("freeing", first*cs, n*cs, allowed); err != nil {
		return err
	}
	for c := first; c < first+n; c++ {
		ti := c / w.perBlock
		off := int64(0)
		if ti < int64(len(w.reft.words)) {
			off = int64(w.reft.words[ti] & reftOffsetMask)
		}
		if off != 0 {
			if err := w.checkClusters("changing refcounts in", off, cs, Kinds(MetaRefcountBlock)); err != nil {
				return err
			}
		}
		rc, err := w.refcountAt(c)
		if err != nil {
			return err
		}
		if rc == 0 {
			err := &FormatError{File: w.l.name, Field: "refcount", Value: 0, Offset: -1,
				Msg: fmt.Sprintf("cluster %#x is referenced but has refcount 0: the image is corrupt; it is marked so and no longer written", c*cs)}
			w.markCorrupt(err)
			return err
		}
	}
	return nil
}

// releaseTable gives back the clusters of a table of the given kind at
// [off, off+n) whose last reference, the header's, is durably gone (an L1
// table or refcount table replaced by a larger one): they must hold that
// table only, they leave the metadata map, and their refcounts drop.
func (w *writer) releaseTable(off, n int64, kind MetaKind) error {
	if err := w.tableReleasable(off, n, kind); err != nil {
		return err
	}
	w.l.metaMap.Store(w.l.metaMap.Load().without(off, off+n, kind))
	cs := w.l.clusterSize()
	for c := off / cs; c < (off+n+cs-1)/cs; c++ {
		if err := w.decref(c); err != nil {
			return err
		}
	}
	return nil
}

// tableReleasable checks, before a table is replaced, that releaseTable
// will be able to give its clusters back.
func (w *writer) tableReleasable(off, n int64, kind MetaKind) error {
	return w.checkClusters("freeing", off, n, Kinds(kind))
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
// durable. kind is what the reference named: an L2 table (MetaL2), or
// guest data (0: a data or compressed cluster). The clusters must hold
// nothing else: a damaged L2 entry naming the L1 table as its data cluster
// would otherwise have the live L1 table freed and punched. An L2 table
// leaves the metadata map now: nothing writes it any more, and it is
// reused only once its refcount reaches zero.
func (w *writer) free(first, n int64, kind MetaKind) error {
	cs := w.l.clusterSize()
	if err := w.freeable(first, n, kind); err != nil {
		return err
	}
	if kind != 0 {
		w.l.metaMap.Store(w.l.metaMap.Load().without(first*cs, (first+n)*cs, kind))
	}
	if k := len(w.pendingFree); k > 0 && w.pendingFree[k-1].first+w.pendingFree[k-1].n == first {
		w.pendingFree[k-1].n += n
		return nil
	}
	w.pendingFree = append(w.pendingFree, freeing{first, n})
	return nil
}

// writeTable writes the dirty part of a cached table back to its cluster,
// whole sectors at a time.
func (w *writer) writeTable(e *cacheEntry, kind MetaKind) error {
	if err := w.writeWords(e.table, e.key.off, kind); err != nil {
		return err
	}
	w.st.tablesFlushed.Add(1)
	return nil
}

// writeWords writes words [dirtyLo, dirtyHi) of t, rounded out to whole
// 512-byte sectors, to the table at off, and marks t clean.
func (w *writer) writeWords(t *table, off int64, kind MetaKind) error {
	if t.dirtyLo >= t.dirtyHi {
		return nil
	}
	lo := t.dirtyLo &^ 63 // 64 words to a sector
	hi := min((t.dirtyHi+63)&^63, len(t.words))
	buf := w.tableBuf(hi - lo)
	for i := lo; i < hi; i++ {
		putWord(buf[(i-lo)*8:], t.word(int64(i)))
	}
	if err := w.writeMeta(buf, off+int64(lo)*8, kind); err != nil {
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

// writeMeta writes metadata of the given kind at off, after checking that
// its clusters hold only metadata of that kind (a free cluster becoming
// one is added to the map before it is written).
func (w *writer) writeMeta(b []byte, off int64, kind MetaKind) error {
	if err := w.checkOverlap(off, int64(len(b)), Kinds(kind)); err != nil {
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
		if err := w.checkOverlap(off, int64(len(b)), 0); err != nil {
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
// writes if a cluster of [off, off+n) of the image file holds metadata of
// a kind not in allowed.
func (w *writer) checkOverlap(off, n int64, allowed MetaKinds) error {
	return w.checkClusters("a write of", off, n, allowed)
}

// checkClusters is checkOverlap for any change of a host range: what says
// what the change is ("a write of", "freeing", "punching").
func (w *writer) checkClusters(what string, off, n int64, allowed MetaKinds) error {
	m := w.l.metaMap.Load()
	r, bad := m.conflict(off, off+n, allowed)
	if !bad {
		return nil
	}
	err := &FormatError{File: w.l.name, Field: "host offset", Value: uint64(off), Offset: -1,
		Msg: fmt.Sprintf("%s %d bytes at %#x would change the %s in cluster %#x: the image is corrupt; it is marked so and no longer written", what, n, off, r.Kinds, r.Start)}
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
	if r, bad := m.conflict(off, off+n, 0); bad {
		err := &FormatError{File: w.l.name, Field: "host offset", Value: uint64(off), Offset: -1,
			Msg: fmt.Sprintf("a new %s at %#x would overlap the %s in cluster %#x: the image is corrupt; it is marked so and no longer written", k, off, r.Kinds, r.Start)}
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
