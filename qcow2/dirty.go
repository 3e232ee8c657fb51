package qcow2

// The dirty set: the tables the writer changed in memory (readers see the
// changes at once) and has not written back yet. A dirty table stays
// pinned in the cache, so that eviction never drops a change; flush.go
// writes them back in order and lets them go. Past maxDirtyBytes of them
// the writer flushes by itself.

// dirtySet is the writer's dirty tables, guarded by w.mu.
type dirtySet struct {
	tables   map[int64]dirtyEntry // L2 tables and refcount blocks, by offset
	bytes    int64                // their memory
	l1       bool                 // L1 entries [l1Lo, l1Hi) changed
	l1Lo     int64
	l1Hi     int64
	writeBuf []byte // where tables are encoded to be written (writeWords)
}

// maxDirtyBytes is the most table data the writer keeps dirty (pinned in
// the cache) before it writes back on its own.
const maxDirtyBytes = 8 << 20

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
	if d, ok := w.dirty.tables[off]; ok {
		if d.kind != kind {
			return nil, w.host.checkOverlap(off, l.clusterSize(), Kinds(kind))
		}
		return d.e.table, nil
	}
	if err := w.host.checkOverlap(off, l.clusterSize(), Kinds(kind)); err != nil {
		return nil, err
	}
	e, err := l.cache.pin(cacheKey{owner: l.owner, off: off}, func() ([]uint64, error) {
		return l.meta.table(off, kind.String())
	})
	if err != nil {
		return nil, err
	}
	w.dirty.tables[off] = dirtyEntry{e, kind}
	w.dirty.bytes += e.bytes()
	return e.table, nil
}

// markDirty records a table of the given kind that the writer put into
// the cache itself (pinned by Cache.put) as dirty.
func (w *writer) markDirty(e *cacheEntry, kind MetaKind) {
	if _, ok := w.dirty.tables[e.key.off]; ok {
		w.l.cache.unpin(e)
		return
	}
	w.dirty.tables[e.key.off] = dirtyEntry{e, kind}
	w.dirty.bytes += e.bytes()
}

// dirtyL1 records that L1 entry i changed.
func (w *writer) dirtyL1(i int64) {
	if !w.dirty.l1 {
		w.dirty.l1Lo, w.dirty.l1Hi, w.dirty.l1 = i, i+1, true
		return
	}
	w.dirty.l1Lo, w.dirty.l1Hi = min(w.dirty.l1Lo, i), max(w.dirty.l1Hi, i+1)
}
