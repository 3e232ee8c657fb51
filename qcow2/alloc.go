package qcow2

import (
	"fmt"
	"sync/atomic"
)

// The allocator: which host clusters are free, and the refcounts that say
// so (specification, "Host cluster management"), as imago's Allocator:
// it holds the refcount table and its own state, and is handed what it
// needs from the rest of the writer (allocEnv).
//
// Refcount blocks go through the table cache like L2 tables; a block the
// allocator changes stays pinned there, dirty (dirty.go), until flush.go
// writes it back. The refcount table lives in the allocator, its changes
// written back the same way (reftableChanges).
//
// Clusters are allocated first fit from freeHint; past the last cluster in
// use (end) the image grows. A refcount block that does not exist yet is
// placed in the first cluster it describes, which is then necessarily free
// (nothing in its range has a refcount), so the block describes itself. A
// table (allocateTable) is placed past the end, with the blocks it needs
// right before it. A refcount table too small for a new block is replaced
// by a larger one (the writer's growReftable, reftable.go, with
// planReftable and switchReftable here). The image file is grown ahead of
// the allocations (allocEnv.reserveFile) under w.mu, so that the growth is
// serialised with the writes into the grown range (they happen only after
// the allocation that grew it returned).

// allocEnv is what the allocator needs from the rest of the writer: the
// refcount blocks, by offset, through the table cache and the dirty set
// (dirty.go); the metadata map and the file's space, through the host
// door (hostwrite.go); and a larger refcount table (reftable.go). The
// writer hands it allocDoors; the allocator's tests a fake.
type allocEnv interface {
	// refblock returns the refcount block at off, for reading: an
	// unaligned offset, or one past the end of the file, is an error.
	refblock(off int64) (*table, error)
	// dirtyRefblock returns the refcount block at off pinned and
	// recorded as dirty, for changing.
	dirtyRefblock(off int64) (*table, error)
	// newRefblock makes an all-zero refcount block at off, pinned and
	// recorded as dirty: all of it to be written if whole, else the
	// entries set in it.
	newRefblock(off int64, whole bool) *table
	// addMeta records new metadata at [off, off+n) in the metadata map.
	addMeta(off, n int64, k MetaKind) error
	// checkClusters fails (and marks the image corrupt) if a cluster of
	// [off, off+n) holds metadata of a kind not in allowed.
	checkClusters(what string, off, n int64, allowed MetaKinds) error
	// reserveFile makes the image file at least size bytes long.
	reserveFile(size int64) error
	// growReftable replaces the refcount table by one with room for at
	// least need entries (and calls back planReftable and
	// switchReftable).
	growReftable(need int64) error
}

// allocator is the writer's allocation state, guarded by w.mu.
type allocator struct {
	env      allocEnv
	file     string // the image file's name, for errors
	cs       int64  // the cluster size
	reft     *table // the refcount table; its dirty range is written back
	reftOff  int64  // where it lies
	ref      refFormat
	end      int64         // first cluster index past every cluster in use (refcount > 0)
	freeHint int64         // no free cluster below this index
	usedEnd  int64         // first cluster index past every cluster this writer gave a refcount
	count    *atomic.Int64 // clusters allocated (WriteStats.Allocations)
}

// newAllocator returns the allocator of an image file with clusters of
// cs bytes, 2^refcountOrder-bit refcounts and the refcount table reft at
// reftOff (the allocator keeps reft), counting allocated clusters in
// count. It finds the end of the clusters in use from the refcount blocks.
func newAllocator(env allocEnv, file string, cs int64, refcountOrder uint32, reft []uint64, reftOff int64, count *atomic.Int64) (*allocator, error) {
	a := &allocator{env: env, file: file, cs: cs, reft: &table{words: reft}, reftOff: reftOff, ref: newRefFormat(refcountOrder, cs), count: count}
	if err := a.findEnd(); err != nil {
		return nil, err
	}
	return a, nil
}

// hostRange is a range [start, end) of host bytes.
type hostRange struct{ start, end int64 }

// refcount returns the refcount of host cluster c.
func (a *allocator) refcount(c int64) (uint64, error) {
	ti := c / a.ref.perBlock
	if ti >= int64(len(a.reft.words)) {
		return 0, nil
	}
	off := int64(a.reft.words[ti] & reftOffsetMask)
	if off == 0 {
		return 0, nil
	}
	t, err := a.env.refblock(off)
	if err != nil {
		return 0, err
	}
	return a.ref.get(t, c%a.ref.perBlock), nil
}

// setRefcount sets the refcount of host cluster c to v, creating the
// refcount block (and growing the refcount table) if needed.
func (a *allocator) setRefcount(c int64, v uint64) error {
	if v > a.ref.max {
		return &FormatError{File: a.file, Field: "refcount", Value: v, Offset: -1,
			Msg: fmt.Sprintf("refcount of cluster %d would overflow %d-bit refcounts", c, a.ref.width)}
	}
	ti := c / a.ref.perBlock
	off, err := a.ensureBlock(ti)
	if err != nil {
		return err
	}
	if _, err := a.env.refblock(off); err != nil {
		return err // (checks the offset)
	}
	t, err := a.env.dirtyRefblock(off)
	if err != nil {
		return err
	}
	a.ref.put(t, c%a.ref.perBlock, v)
	if v > 0 {
		a.usedEnd = max(a.usedEnd, c+1)
	}
	if v > 0 && c >= a.end {
		a.end = c + 1
	}
	return nil
}

// ensureBlock returns the offset of refcount block ti, allocating it in
// the first cluster of the range it describes if there is none (imago's
// ensure_rb).
func (a *allocator) ensureBlock(ti int64) (int64, error) {
	if ti >= int64(len(a.reft.words)) {
		if err := a.env.growReftable(ti + 1); err != nil {
			return 0, err
		}
	}
	if off := int64(a.reft.words[ti] & reftOffsetMask); off != 0 {
		return off, nil
	}
	// Nothing in [ti*perBlock, (ti+1)*perBlock) has a refcount, so its
	// first cluster is free: the block goes there and counts itself.
	c := ti * a.ref.perBlock
	off := c * a.cs
	if err := a.env.reserveFile(off + a.cs); err != nil {
		return 0, err
	}
	t := a.env.newRefblock(off, false)
	a.ref.put(t, 0, 1)
	if err := a.env.addMeta(off, a.cs, MetaRefcountBlock); err != nil {
		return 0, err
	}
	a.reft.set(ti, uint64(off))
	if c >= a.end {
		a.end = c + 1
	}
	a.usedEnd = max(a.usedEnd, c+1)
	return off, nil
}

// allocate finds n free host clusters, in as few contiguous runs as it
// can, gives them refcount 1 and returns the runs (host offsets, in
// allocation order). Clusters are not contiguous where a refcount block
// sits in between (with 64-bit refcounts and small clusters, every block
// does so every few dozen clusters). Ordering: the refcount blocks that
// count a run exist, and the file reaches its end, before any refcount of
// it is set; the refcounts reach the disk at the next flush, before
// anything that names the clusters (flush.go, step 1).
func (a *allocator) allocate(n int64) ([]hostRange, error) {
	var runs []hostRange
	cs := a.cs
	for n > 0 {
		c, k, err := a.findFree(n)
		if err != nil {
			return nil, err
		}
		// The blocks that count the run must exist first: making one
		// may take a cluster of the run, so look again.
		again := false
		for ti := c / a.ref.perBlock; ti <= (c+k-1)/a.ref.perBlock; ti++ {
			if ti >= int64(len(a.reft.words)) || a.reft.words[ti]&reftOffsetMask == 0 {
				if _, err := a.ensureBlock(ti); err != nil {
					return nil, err
				}
				again = true
			}
		}
		if again {
			continue
		}
		if err := a.soundBlocks(c, c+k); err != nil {
			return nil, err
		}
		if err := a.env.reserveFile((c + k) * cs); err != nil {
			return nil, err
		}
		for i := c; i < c+k; i++ {
			if err := a.setRefcount(i, 1); err != nil {
				return nil, err
			}
		}
		a.freeHint = c + k
		a.count.Add(k)
		if m := len(runs); m > 0 && runs[m-1].end == c*cs {
			runs[m-1].end = (c + k) * cs
		} else {
			runs = append(runs, hostRange{c * cs, (c + k) * cs})
		}
		n -= k
	}
	return runs, nil
}

// allocateOne allocates one cluster and returns its host offset.
func (a *allocator) allocateOne() (int64, error) {
	runs, err := a.allocate(1)
	if err != nil {
		return 0, err
	}
	return runs[0].start, nil
}

// allocateTable allocates n contiguous clusters for a table (an L1 table,
// a bitmap table) past the end of what is in use, and returns the first.
// The refcount blocks the range needs and lacks go right before it, each
// counting whatever of the blocks and the table lies in its range: a block
// placed in the range it counts would split the table. The caller makes
// the refcounts durable, with the refcount table entries naming new
// blocks, before anything on disk names the table (writer.persistRefcounts).
func (a *allocator) allocateTable(n int64) (int64, error) {
	cs := a.cs
	for {
		start := a.end
		var blocks []int64
		for nb := int64(0); ; {
			blocks = a.missingBlocks(start, start+nb+n, blocks[:0])
			if int64(len(blocks)) == nb {
				break
			}
			nb = int64(len(blocks))
		}
		if len(blocks) > 0 && blocks[len(blocks)-1] >= int64(len(a.reft.words)) {
			// The refcount table grows first (into the end), then look
			// again.
			if err := a.env.growReftable(blocks[len(blocks)-1] + 1); err != nil {
				return 0, err
			}
			continue
		}
		nb := int64(len(blocks))
		end := start + nb + n
		if err := a.soundBlocks(start, end); err != nil {
			return 0, err
		}
		if err := a.env.reserveFile(end * cs); err != nil {
			return 0, err
		}
		for k, ti := range blocks {
			bc := start + int64(k)
			if err := a.env.addMeta(bc*cs, cs, MetaRefcountBlock); err != nil {
				return 0, err
			}
			a.env.newRefblock(bc*cs, true)
			a.reft.set(ti, uint64(bc*cs))
		}
		for c := start; c < end; c++ {
			if err := a.setRefcount(c, 1); err != nil {
				return 0, err
			}
		}
		return (start + nb) * cs, nil
	}
}

// soundBlocks checks, before the allocator changes refcounts of clusters
// [start, end), that the existing refcount blocks counting them are
// refcount blocks only: a refcount table entry naming another table would
// otherwise have refcounts written into it (and the file grown for
// clusters it only seems to count).
func (a *allocator) soundBlocks(start, end int64) error {
	for ti := start / a.ref.perBlock; ti <= (end-1)/a.ref.perBlock && ti < int64(len(a.reft.words)); ti++ {
		if off := int64(a.reft.words[ti] & reftOffsetMask); off != 0 {
			if err := a.env.checkClusters("changing refcounts in", off, a.cs, Kinds(MetaRefcountBlock)); err != nil {
				return err
			}
		}
	}
	return nil
}

// missingBlocks appends to out the indices, in increasing order, of the
// refcount blocks that clusters [start, end) need and that do not exist.
func (a *allocator) missingBlocks(start, end int64, out []int64) []int64 {
	for ti := start / a.ref.perBlock; ti <= (end-1)/a.ref.perBlock; ti++ {
		if ti >= int64(len(a.reft.words)) || a.reft.words[ti]&reftOffsetMask == 0 {
			out = append(out, ti)
		}
	}
	return out
}

// findFree returns the first free cluster at or after freeHint and how many
// free clusters follow it, at most n; past the end of what is in use
// everything is free.
func (a *allocator) findFree(n int64) (c, k int64, err error) {
	c = a.freeHint
	for c < a.end {
		rc, err := a.refcount(c)
		if err != nil {
			return 0, 0, err
		}
		if rc != 0 {
			c++
			continue
		}
		k = 1
		for k < n && c+k < a.end {
			rc, err := a.refcount(c + k)
			if err != nil {
				return 0, 0, err
			}
			if rc != 0 {
				return c, k, nil
			}
			k++
		}
		if k == n {
			return c, k, nil
		}
		return c, n, nil // it reaches the end, where all is free
	}
	return max(c, a.end), n, nil
}

// findEnd finds the first cluster past every cluster in use, from the
// refcount blocks, at open.
func (a *allocator) findEnd() error {
	for ti := int64(len(a.reft.words)) - 1; ti >= 0; ti-- {
		off := int64(a.reft.words[ti] & reftOffsetMask)
		if off == 0 {
			continue
		}
		t, err := a.env.refblock(off)
		if err != nil {
			return err
		}
		for i := a.ref.perBlock - 1; i >= 0; i-- {
			if a.ref.get(t, i) != 0 {
				a.end = ti*a.ref.perBlock + i + 1
				return nil
			}
		}
	}
	return nil
}

// released records that cluster c's refcount dropped to zero (freeing.go):
// the allocator may hand it out again.
func (a *allocator) released(c int64) { a.freeHint = min(a.freeHint, c) }

// inUseEnd is the first cluster index past every cluster in use.
func (a *allocator) inUseEnd() int64 { return a.end }

// countedEnd is the first cluster index past every cluster this writer
// gave a refcount: the host door gives back the file's space past it and
// past the file's size at open (hostDoor.giveBack).
func (a *allocator) countedEnd() int64 { return a.usedEnd }

// reftable returns where the refcount table lies and its length in
// entries.
func (a *allocator) reftable() (off, entries int64) {
	return a.reftOff, int64(len(a.reft.words))
}

// reftableChanges returns the refcount table and its offset if entries
// of it changed since it was last written (nil if none): the flush
// writes them once the blocks they name are durable.
func (a *allocator) reftableChanges() (*table, int64) {
	if a.reft.dirtyLo >= a.reft.dirtyHi {
		return nil, 0
	}
	return a.reft, a.reftOff
}

// reftableGrowth is a larger refcount table laid out past the clusters in
// use (planReftable): nb new refcount blocks from cluster start, then the
// table, to areaEnd; every cluster of the area counted, by the new blocks
// or by existing ones.
type reftableGrowth struct {
	start, tableStart, areaEnd int64      // cluster indices
	blocks                     []int64    // the new blocks' refcount table indices, at clusters start, start+1, ...
	blockWords                 [][]uint64 // their contents
	table                      []uint64   // the new refcount table
}

// planReftable lays out a refcount table with room for at least need
// entries (specification, "refcount_table_offset"), past the end of what
// is in use: the area's clusters that existing blocks count get their
// refcount there (dirty, written with the new blocks); the new blocks,
// which count the rest of the area and block need-1, and the new table
// are returned to be written. The file is grown for the area. Nothing
// else changes until switchReftable.
func (a *allocator) planReftable(need int64) (*reftableGrowth, error) {
	cs := a.cs
	oldLen := int64(len(a.reft.words))
	newLen := max(need, oldLen+oldLen/2+1)
	perCluster := cs / 8
	newLen = (newLen + perCluster - 1) / perCluster * perCluster
	tableClusters := newLen / perCluster

	// The area: nb new blocks, then the table, from the end. The new
	// blocks are the missing ones that count the area, and block need-1.
	start := a.end
	var blocks []int64 // table indices of the new blocks
	for nb := int64(0); ; {
		areaEnd := start + nb + tableClusters
		blocks = blocks[:0]
		seen := map[int64]bool{}
		for c := start; c < areaEnd; c++ {
			ti := c / a.ref.perBlock
			if !seen[ti] && (ti >= oldLen || a.reft.words[ti]&reftOffsetMask == 0) {
				seen[ti] = true
				blocks = append(blocks, ti)
			}
		}
		if ti := need - 1; !seen[ti] && (ti >= oldLen || a.reft.words[ti]&reftOffsetMask == 0) {
			blocks = append(blocks, ti)
		}
		if int64(len(blocks)) == nb {
			break
		}
		nb = int64(len(blocks))
	}
	nb := int64(len(blocks))
	g := &reftableGrowth{start: start, tableStart: start + nb, blocks: blocks}
	g.areaEnd = g.tableStart + tableClusters
	if err := a.soundBlocks(start, g.areaEnd); err != nil {
		return nil, err
	}
	if err := a.env.reserveFile(g.areaEnd * cs); err != nil {
		return nil, err
	}

	// The area's clusters that existing blocks count get their refcount
	// there; those blocks are written with the new ones, before the
	// switch.
	for c := start; c < g.areaEnd; c++ {
		if ti := c / a.ref.perBlock; ti < oldLen && a.reft.words[ti]&reftOffsetMask != 0 {
			if err := a.setRefcount(c, 1); err != nil {
				return nil, err
			}
		}
	}
	g.table = make([]uint64, newLen)
	copy(g.table, a.reft.words)
	for k, ti := range blocks {
		bc := start + int64(k) // the block's cluster
		words := make([]uint64, cs/8)
		t := &table{words: words}
		for c := max(start, ti*a.ref.perBlock); c < min(g.areaEnd, (ti+1)*a.ref.perBlock); c++ {
			a.ref.put(t, c-ti*a.ref.perBlock, 1)
		}
		g.blockWords = append(g.blockWords, words)
		g.table[ti] = uint64(bc * cs)
	}
	return g, nil
}

// switchReftable makes g's table the refcount table, once the header
// names it (durably: reftable.go).
func (a *allocator) switchReftable(g *reftableGrowth) {
	a.reftOff = g.tableStart * a.cs
	a.reft = &table{words: g.table}
	a.end = max(a.end, g.areaEnd)
	a.usedEnd = max(a.usedEnd, g.areaEnd)
}
