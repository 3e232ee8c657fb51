package qcow2

// The ordered write-back of dirty metadata (crosvm's sync_caches, qemu's
// qcow2_cache_flush with its dependencies).
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
//     (freeing.go). A cluster whose refcount reaches zero is reused only
//     once no request that could still map it is left: stricter than
//     qemu, which reuses at once, so that after a crash no guest offset can
//     read another offset's data.
//
// A crash between any two writes leaves at worst clusters whose refcount
// is higher than their references (leaks), never the reverse.

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
// removed references' clusters go. A failure sticks (hostDoor.fail).
func (w *writer) flushLocked() error {
	if err := w.host.usable(); err != nil {
		return err
	}
	w.st.flushes.Add(1)
	// 0. The bitmaps' changed data (bitmapwrite.go): allocating clusters
	// for it changes refcounts, written next.
	if err := w.storeBitmaps(); err != nil {
		return err
	}
	// 1. Refcount blocks, then sync with the data.
	if err := w.writeRefblocks(); err != nil {
		return err
	}
	if err := w.host.syncAll(); err != nil {
		return err
	}
	// 2. The refcount table's new entries.
	if err := w.writeReftable(); err != nil {
		return err
	}
	// 3. L2 tables, and the bitmap tables' new entries.
	wrote, err := w.writeBitmapTables()
	if err != nil {
		return err
	}
	if l2s := w.dirty.ofKind(MetaL2); len(l2s) > 0 || wrote {
		for _, e := range l2s {
			if err := w.host.writeTable(e, MetaL2); err != nil {
				return w.host.fail(err)
			}
		}
		if err := w.host.sync(); err != nil {
			return err
		}
	}
	// 4. L1 entries.
	if lo, hi, ok := w.dirty.l1Range(); ok {
		t := w.l.l1.Load()
		buf := make([]byte, (hi-lo)*8)
		for i := lo; i < hi; i++ {
			putWord(buf[(i-lo)*8:], uint64(t.entry(i)))
		}
		if err := w.host.writeMeta(buf, t.off+lo*8, MetaL1); err != nil {
			return w.host.fail(err)
		}
		if err := w.host.sync(); err != nil {
			return err
		}
	}
	w.dirty.clean()
	// 5. The removed references are durably gone.
	if err := w.frees.release(); err != nil {
		return err
	}
	if w.host.ranShort() {
		w.host.giveBack(w.alloc.countedEnd())
	}
	return nil
}

// persistRefcounts makes every refcount change so far durable, and the
// refcount table entries that name new refcount blocks with them (steps 1
// and 2 above, for the image file), without the rest of a flush. A switch
// to a table the allocator just placed (the header's L1 or refcount table
// pointer, a bitmap's directory entry) is made only after it: the new
// table's refcount may lie in a block that only the in-memory refcount
// table names yet, and a refcount in a block the file's refcount table
// does not name counts for nothing (after a crash: "refcount=0
// reference=1", and the next allocation reuses a live table).
//
// Writing refcounts early is always safe: an increment durable before the
// reference is a leak at worst, and a decrement is only made once the
// reference's removal is durable. The blocks stay pinned, clean, until
// the next flush lets them go.
func (w *writer) persistRefcounts() error {
	if err := w.writeRefblocks(); err != nil {
		return err
	}
	if err := w.host.sync(); err != nil {
		return err
	}
	return w.writeReftable()
}

// writeRefblocks writes back the dirty refcount blocks (step 1, without
// its sync).
func (w *writer) writeRefblocks() error {
	for _, e := range w.dirty.ofKind(MetaRefcountBlock) {
		if err := w.host.writeTable(e, MetaRefcountBlock); err != nil {
			return w.host.fail(err)
		}
	}
	return nil
}

// writeReftable writes the refcount table's changed entries and syncs
// them (step 2), once the blocks they name are durable (the caller's
// sync).
func (w *writer) writeReftable() error {
	t, off := w.alloc.reftableChanges()
	if t == nil {
		return nil
	}
	if err := w.host.writeWords(t, off, MetaRefcountTable); err != nil {
		return w.host.fail(err)
	}
	return w.host.sync()
}
