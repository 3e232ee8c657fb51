package qcow2

// The refcount table's growth: the writer's orchestration of the
// allocator's planReftable and switchReftable, the host door's writes and
// header switch, and the free lists' release of the old table.

// growReftable replaces the refcount table by one with room for at least
// need entries (specification, "refcount_table_offset"), in this order,
// each step durable before the next:
//
//  0. the old table's clusters are checked to hold nothing else (else the
//     image is corrupt, and nothing is changed);
//  1. everything dirty is written back (flushLocked): the new table must
//     not name blocks that are not durable;
//  2. the new refcount blocks (counting themselves, the new table, and
//     the area's clusters no existing block counts) and the existing
//     blocks that count the rest of the area are written, then the new
//     table, past the end of what is in use, and synced;
//  3. the header is switched to the new table with one synced write of
//     its first sector;
//  4. only then are the old table's clusters freed.
//
// A crash before 3 leaves the old table in use and the area leaked; after
// it, at worst the old table leaked.
func (w *writer) growReftable(need int64) error {
	l := w.l
	cs := l.clusterSize()
	oldOff, oldLen := w.alloc.reftable()
	if err := w.frees.tableReleasable(oldOff, oldLen*8, MetaRefcountTable); err != nil {
		return err
	}
	if err := w.flushLocked(); err != nil {
		return err
	}
	g, err := w.alloc.planReftable(need)
	if err != nil {
		return err
	}
	buf := make([]byte, cs)
	for k, words := range g.blockWords {
		bc := g.start + int64(k) // the block's cluster
		encodeWords(buf, words)
		if err := w.host.addMeta(bc*cs, cs, MetaRefcountBlock); err != nil {
			return err
		}
		if err := w.host.writeMeta(buf, bc*cs, MetaRefcountBlock); err != nil {
			return err
		}
		l.cache.unpin(l.cache.put(cacheKey{owner: l.owner, off: bc * cs}, words))
	}
	if err := w.writeRefblocks(); err != nil {
		return err
	}
	tableClusters := g.areaEnd - g.tableStart
	tb := make([]byte, len(g.table)*8)
	encodeWords(tb, g.table)
	if err := w.host.addMeta(g.tableStart*cs, tableClusters*cs, MetaRefcountTable); err != nil {
		return err
	}
	if err := w.host.writeMeta(tb, g.tableStart*cs, MetaRefcountTable); err != nil {
		return err
	}
	if err := w.host.sync(); err != nil {
		return err
	}
	if err := w.host.updateHeader(func(h []byte) {
		fieldRefcountTableOffset.put(h, uint64(g.tableStart*cs))
		fieldRefcountTableClusters.put(h, uint64(tableClusters))
	}); err != nil {
		return err
	}
	w.alloc.switchReftable(g)
	// The header no longer names the old table: its clusters are free.
	return w.frees.releaseTable(oldOff, oldLen*8/cs*cs, MetaRefcountTable)
}
