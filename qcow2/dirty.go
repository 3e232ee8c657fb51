package qcow2

import "fmt"

// The dirty set: the tables the writer changed in memory (readers see the
// changes at once) and has not written back yet. A dirty table stays
// pinned in the cache, so that eviction never drops a change; flush.go
// walks the set in its order (refcount blocks, L2 tables, the L1 range)
// and lets the tables go (clean). Past maxDirtyBytes of them the writer
// flushes by itself (full).

// dirtySet is the writer's dirty tables, guarded by w.mu.
type dirtySet struct {
	l      *layer
	host   *hostDoor            // the metadata map's checks, the file's size
	tables map[int64]dirtyEntry // L2 tables and refcount blocks, by offset
	bytes  int64                // their memory
	l1     bool                 // L1 entries [l1Lo, l1Hi) changed
	l1Lo   int64
	l1Hi   int64
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

func newDirtySet(l *layer, host *hostDoor) dirtySet {
	return dirtySet{l: l, host: host, tables: map[int64]dirtyEntry{}}
}

// table returns the cached table of the given kind at off (an L2 table or
// a refcount block of the image file), pinned and recorded as dirty, for
// the writer to change. Its cluster must hold that kind of metadata only:
// an L1 entry naming the refcount table as an L2 table would otherwise
// have L2 entries written into it (checkOverlap marks the image corrupt
// instead).
func (d *dirtySet) table(off int64, kind MetaKind) (*table, error) {
	l := d.l
	if de, ok := d.tables[off]; ok {
		if de.kind != kind {
			return nil, d.host.checkOverlap(off, l.clusterSize(), Kinds(kind))
		}
		return de.e.table, nil
	}
	if err := d.host.checkOverlap(off, l.clusterSize(), Kinds(kind)); err != nil {
		return nil, err
	}
	e, err := l.cache.pin(cacheKey{owner: l.owner, off: off}, func() ([]uint64, error) {
		return l.meta.table(off, kind.String())
	})
	if err != nil {
		return nil, err
	}
	d.tables[off] = dirtyEntry{e, kind}
	d.bytes += e.bytes()
	return e.table, nil
}

// put installs words as a new table of the given kind at off (an L2 table
// or a refcount block the writer made), pinned and recorded as dirty:
// all of it to be written if whole, else only what is changed in it.
func (d *dirtySet) put(off int64, words []uint64, kind MetaKind, whole bool) *table {
	l := d.l
	e := l.cache.put(cacheKey{owner: l.owner, off: off}, words)
	if whole {
		e.table.touch(0, len(words))
	}
	if _, ok := d.tables[off]; ok {
		l.cache.unpin(e)
		return e.table
	}
	d.tables[off] = dirtyEntry{e, kind}
	d.bytes += e.bytes()
	return e.table
}

// markL1 records that L1 entry i changed.
func (d *dirtySet) markL1(i int64) {
	if !d.l1 {
		d.l1Lo, d.l1Hi, d.l1 = i, i+1, true
		return
	}
	d.l1Lo, d.l1Hi = min(d.l1Lo, i), max(d.l1Hi, i+1)
}

// The allocator's refcount blocks (allocEnv).

// refblock returns the cached refcount block at off, for reading (not
// pinned: a change goes through dirtyRefblock). off must be cluster
// aligned and inside the file as the writer made it.
func (d *dirtySet) refblock(off int64) (*table, error) {
	l := d.l
	if off&(l.clusterSize()-1) != 0 || off > d.host.size()-l.clusterSize() {
		return nil, &FormatError{File: l.name, Field: "refcount table entry", Value: uint64(off), Offset: -1,
			Msg: fmt.Sprintf("refcount block offset %#x is unaligned or past the end of the file", off)}
	}
	e, err := l.cache.entry(cacheKey{owner: l.owner, off: off}, func() ([]uint64, error) {
		return l.meta.table(off, "refcount block")
	})
	if err != nil {
		return nil, err
	}
	return e.table, nil
}

// dirtyRefblock is table for a refcount block.
func (d *dirtySet) dirtyRefblock(off int64) (*table, error) {
	return d.table(off, MetaRefcountBlock)
}

// newRefblock is put for a new, all-zero refcount block.
func (d *dirtySet) newRefblock(off int64, whole bool) *table {
	return d.put(off, make([]uint64, d.l.clusterSize()/8), MetaRefcountBlock, whole)
}

// The flush's walk (flush.go), in its order.

// ofKind returns the dirty tables of one kind: MetaRefcountBlock for the
// flush's step 1, MetaL2 for step 3.
func (d *dirtySet) ofKind(kind MetaKind) []*cacheEntry {
	var out []*cacheEntry
	for _, de := range d.tables {
		if de.kind == kind {
			out = append(out, de.e)
		}
	}
	return out
}

// l1Range returns the L1 entries [lo, hi) changed, for step 4; ok is
// false if none did.
func (d *dirtySet) l1Range() (lo, hi int64, ok bool) { return d.l1Lo, d.l1Hi, d.l1 }

// clean lets every table go, written back (unpinned in the cache), and
// forgets the L1 range: after step 4.
func (d *dirtySet) clean() {
	for _, de := range d.tables {
		d.l.cache.unpin(de.e)
	}
	clear(d.tables)
	d.bytes = 0
	d.l1 = false
}

// full reports whether the writer should write back now: more than
// maxDirtyBytes of tables are dirty.
func (d *dirtySet) full() bool { return d.bytes > maxDirtyBytes }

// empty reports whether nothing is dirty.
func (d *dirtySet) empty() bool { return len(d.tables) == 0 && !d.l1 }
