package qcow2

import (
	"fmt"
)

// The allocator: which host clusters are free, and the refcounts that say
// so (specification, "Host cluster management").
//
// Refcount blocks go through the table cache like L2 tables; a block the
// writer changes stays pinned there, dirty (dirty.go), until flush.go
// writes it back. The refcount table lives in the allocator, its changes
// written back the same way.
//
// Clusters are allocated first fit from freeHint; past the last cluster in
// use (end) the image grows. A refcount block that does not exist yet is
// placed in the first cluster it describes, which is then necessarily free
// (nothing in its range has a refcount), so the block describes itself. A
// refcount table too small for a new block is replaced by a larger one
// (growReftable). The image file is grown ahead of the allocations
// (hostwrite.go, reserveFile) under w.mu, so that the growth is serialised
// with the writes into the grown range (they happen only after the
// allocation that grew it returned).

// allocator is the writer's allocation state (imago's Allocator), guarded
// by w.mu.
type allocator struct {
	reft     *table // the refcount table; its dirty range is written back
	reftOff  int64  // where it lies
	ref      refFormat
	end      int64 // first cluster index past every cluster in use (refcount > 0)
	freeHint int64 // no free cluster below this index
	usedEnd  int64 // first cluster index past every cluster this writer gave a refcount
}

// refFormat is how refcount entries are laid out in a refcount block.
type refFormat struct {
	perBlock int64  // entries per refcount block
	width    uint   // bits per entry
	max      uint64 // the largest refcount an entry holds
}

func newRefFormat(order uint32, clusterSize int64) refFormat {
	f := refFormat{width: 1 << order}
	f.perBlock = clusterSize * 8 / int64(f.width)
	f.max = 1<<f.width - 1
	if f.width == 64 {
		f.max = ^uint64(0)
	}
	return f
}

// hostRange is a range [start, end) of host bytes.
type hostRange struct{ start, end int64 }

// refcountAt returns the refcount of host cluster c.
func (w *writer) refcountAt(c int64) (uint64, error) {
	ti := c / w.alloc.ref.perBlock
	if ti >= int64(len(w.alloc.reft.words)) {
		return 0, nil
	}
	off := int64(w.alloc.reft.words[ti] & reftOffsetMask)
	if off == 0 {
		return 0, nil
	}
	e, err := w.refblock(off)
	if err != nil {
		return 0, err
	}
	return w.alloc.ref.get(e.table, c%w.alloc.ref.perBlock), nil
}

// refblock returns the cache entry of the refcount block at off (not
// pinned: callers that change it pin it through dirty).
func (w *writer) refblock(off int64) (*cacheEntry, error) {
	l := w.l
	if off&(l.clusterSize()-1) != 0 || off > w.host.fileEnd-l.clusterSize() {
		return nil, &FormatError{File: l.name, Field: "refcount table entry", Value: uint64(off), Offset: -1,
			Msg: fmt.Sprintf("refcount block offset %#x is unaligned or past the end of the file", off)}
	}
	return l.cache.entry(cacheKey{owner: l.owner, off: off}, func() ([]uint64, error) {
		return l.meta.table(off, "refcount block")
	})
}

// shift is where entry i sits in its 64-bit word: entries narrower than a
// byte are packed from the least significant bit of each byte, wider ones
// are big-endian.
func (f refFormat) shift(i int64) (word int64, shift uint) {
	width := int64(f.width)
	bit := i * width
	word = bit / 64
	if width >= 8 {
		return word, uint(64 - bit%64 - width)
	}
	byteInWord := (bit / 8) % 8
	return word, uint(56 - 8*byteInWord + bit%8)
}

// get returns entry i of refcount block t.
func (f refFormat) get(t *table, i int64) uint64 {
	word, shift := f.shift(i)
	return (t.word(word) >> shift) & f.max
}

// put sets entry i of refcount block t to v.
func (f refFormat) put(t *table, i int64, v uint64) {
	word, shift := f.shift(i)
	old := t.word(word)
	t.set(word, old&^(f.max<<shift)|v<<shift)
}

// setRefcount sets the refcount of host cluster c to v, creating the
// refcount block (and growing the refcount table) if needed.
func (w *writer) setRefcount(c int64, v uint64) error {
	if v > w.alloc.ref.max {
		return &FormatError{File: w.l.name, Field: "refcount", Value: v, Offset: -1,
			Msg: fmt.Sprintf("refcount of cluster %d would overflow %d-bit refcounts", c, w.alloc.ref.width)}
	}
	ti := c / w.alloc.ref.perBlock
	off, err := w.ensureRefblock(ti)
	if err != nil {
		return err
	}
	if _, err := w.refblock(off); err != nil {
		return err // (checks the offset)
	}
	t, err := w.dirtyTable(off, MetaRefcountBlock)
	if err != nil {
		return err
	}
	w.alloc.ref.put(t, c%w.alloc.ref.perBlock, v)
	if v > 0 {
		w.alloc.usedEnd = max(w.alloc.usedEnd, c+1)
	}
	if v > 0 && c >= w.alloc.end {
		w.alloc.end = c + 1
	}
	return nil
}

// ensureRefblock returns the offset of refcount block ti, allocating it in
// the first cluster of the range it describes if there is none.
func (w *writer) ensureRefblock(ti int64) (int64, error) {
	if ti >= int64(len(w.alloc.reft.words)) {
		if err := w.growReftable(ti + 1); err != nil {
			return 0, err
		}
	}
	if off := int64(w.alloc.reft.words[ti] & reftOffsetMask); off != 0 {
		return off, nil
	}
	// Nothing in [ti*perBlock, (ti+1)*perBlock) has a refcount, so its
	// first cluster is free: the block goes there and counts itself.
	cs := w.l.clusterSize()
	c := ti * w.alloc.ref.perBlock
	off := c * cs
	if err := w.host.reserveFile(off + cs); err != nil {
		return 0, err
	}
	words := make([]uint64, cs/8)
	e := w.l.cache.put(cacheKey{owner: w.l.owner, off: off}, words)
	w.markDirty(e, MetaRefcountBlock)
	w.alloc.ref.put(e.table, 0, 1)
	if err := w.host.addMeta(off, cs, MetaRefcountBlock); err != nil {
		return 0, err
	}
	w.alloc.reft.set(ti, uint64(off))
	if c >= w.alloc.end {
		w.alloc.end = c + 1
	}
	w.alloc.usedEnd = max(w.alloc.usedEnd, c+1)
	return off, nil
}

// allocate finds n free host clusters, in as few contiguous runs as it
// can, gives them refcount 1 and returns the runs (host offsets, in
// allocation order). Clusters are not contiguous where a refcount block
// sits in between (with 64-bit refcounts and small clusters, every block
// does so every few dozen clusters).
func (w *writer) allocate(n int64) ([]hostRange, error) {
	var runs []hostRange
	cs := w.l.clusterSize()
	for n > 0 {
		c, k, err := w.findFree(n)
		if err != nil {
			return nil, err
		}
		// The blocks that count the run must exist first: making one
		// may take a cluster of the run, so look again.
		again := false
		for ti := c / w.alloc.ref.perBlock; ti <= (c+k-1)/w.alloc.ref.perBlock; ti++ {
			if ti >= int64(len(w.alloc.reft.words)) || w.alloc.reft.words[ti]&reftOffsetMask == 0 {
				if _, err := w.ensureRefblock(ti); err != nil {
					return nil, err
				}
				again = true
			}
		}
		if again {
			continue
		}
		if err := w.soundBlocks(c, c+k); err != nil {
			return nil, err
		}
		if err := w.host.reserveFile((c + k) * cs); err != nil {
			return nil, err
		}
		for i := c; i < c+k; i++ {
			if err := w.setRefcount(i, 1); err != nil {
				return nil, err
			}
		}
		w.alloc.freeHint = c + k
		w.st.allocations.Add(k)
		if m := len(runs); m > 0 && runs[m-1].end == c*cs {
			runs[m-1].end = (c + k) * cs
		} else {
			runs = append(runs, hostRange{c * cs, (c + k) * cs})
		}
		n -= k
	}
	return runs, nil
}

// allocateTable allocates n contiguous clusters for a table (an L1 table)
// past the end of what is in use, and returns the first. The refcount
// blocks the range needs and lacks go right before it, each counting
// whatever of the blocks and the table lies in its range: a block placed
// in the range it counts would split the table.
func (w *writer) allocateTable(n int64) (int64, error) {
	cs := w.l.clusterSize()
	for {
		start := w.alloc.end
		var blocks []int64
		for nb := int64(0); ; {
			blocks = w.missingBlocks(start, start+nb+n, blocks[:0])
			if int64(len(blocks)) == nb {
				break
			}
			nb = int64(len(blocks))
		}
		if len(blocks) > 0 && blocks[len(blocks)-1] >= int64(len(w.alloc.reft.words)) {
			// The refcount table grows first (into the end), then look
			// again.
			if err := w.growReftable(blocks[len(blocks)-1] + 1); err != nil {
				return 0, err
			}
			continue
		}
		nb := int64(len(blocks))
		end := start + nb + n
		if err := w.soundBlocks(start, end); err != nil {
			return 0, err
		}
		if err := w.host.reserveFile(end * cs); err != nil {
			return 0, err
		}
		for k, ti := range blocks {
			bc := start + int64(k)
			if err := w.host.addMeta(bc*cs, cs, MetaRefcountBlock); err != nil {
				return 0, err
			}
			e := w.l.cache.put(cacheKey{owner: w.l.owner, off: bc * cs}, make([]uint64, cs/8))
			e.table.touch(0, len(e.table.words))
			w.markDirty(e, MetaRefcountBlock)
			w.alloc.reft.set(ti, uint64(bc*cs))
		}
		for c := start; c < end; c++ {
			if err := w.setRefcount(c, 1); err != nil {
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
func (w *writer) soundBlocks(start, end int64) error {
	cs := w.l.clusterSize()
	for ti := start / w.alloc.ref.perBlock; ti <= (end-1)/w.alloc.ref.perBlock && ti < int64(len(w.alloc.reft.words)); ti++ {
		if off := int64(w.alloc.reft.words[ti] & reftOffsetMask); off != 0 {
			if err := w.host.checkClusters("changing refcounts in", off, cs, Kinds(MetaRefcountBlock)); err != nil {
				return err
			}
		}
	}
	return nil
}

// missingBlocks appends to out the indices, in increasing order, of the
// refcount blocks that clusters [start, end) need and that do not exist.
func (w *writer) missingBlocks(start, end int64, out []int64) []int64 {
	for ti := start / w.alloc.ref.perBlock; ti <= (end-1)/w.alloc.ref.perBlock; ti++ {
		if ti >= int64(len(w.alloc.reft.words)) || w.alloc.reft.words[ti]&reftOffsetMask == 0 {
			out = append(out, ti)
		}
	}
	return out
}

// allocateOne allocates one cluster and returns its host offset.
func (w *writer) allocateOne() (int64, error) {
	runs, err := w.allocate(1)
	if err != nil {
		return 0, err
	}
	return runs[0].start, nil
}

// findFree returns the first free cluster at or after freeHint and how many
// free clusters follow it, at most n; past the end of what is in use
// everything is free.
func (w *writer) findFree(n int64) (c, k int64, err error) {
	c = w.alloc.freeHint
	for c < w.alloc.end {
		rc, err := w.refcountAt(c)
		if err != nil {
			return 0, 0, err
		}
		if rc != 0 {
			c++
			continue
		}
		k = 1
		for k < n && c+k < w.alloc.end {
			rc, err := w.refcountAt(c + k)
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
	return max(c, w.alloc.end), n, nil
}

// findEnd finds the first cluster past every cluster in use, from the
// refcount blocks, at open.
func (w *writer) findEnd() error {
	for ti := int64(len(w.alloc.reft.words)) - 1; ti >= 0; ti-- {
		off := int64(w.alloc.reft.words[ti] & reftOffsetMask)
		if off == 0 {
			continue
		}
		e, err := w.refblock(off)
		if err != nil {
			return err
		}
		for i := w.alloc.ref.perBlock - 1; i >= 0; i-- {
			if w.alloc.ref.get(e.table, i) != 0 {
				w.alloc.end = ti*w.alloc.ref.perBlock + i + 1
				return nil
			}
		}
	}
	return nil
}

// growReftable replaces the refcount table by one with room for at least
// need entries (specification, "refcount_table_offset"): new refcount
// blocks and the new table are written past the end of what is in use,
// the blocks counting themselves and the table; once they are durable the
// header is switched to the new table with one synced write of its first
// sector; then the old table's clusters are freed.
func (w *writer) growReftable(need int64) error {
	l := w.l
	cs := l.clusterSize()
	if err := w.tableReleasable(w.alloc.reftOff, int64(len(w.alloc.reft.words))*8, MetaRefcountTable); err != nil {
		return err
	}
	// The new table must not point at blocks that are not durable: write
	// everything back first.
	if err := w.flushLocked(); err != nil {
		return err
	}
	oldLen := int64(len(w.alloc.reft.words))
	newLen := max(need, oldLen+oldLen/2+1)
	perCluster := cs / 8
	newLen = (newLen + perCluster - 1) / perCluster * perCluster
	tableClusters := newLen / perCluster

	// The area: nb new blocks, then the table, from the end. The new
	// blocks are the missing ones that count the area, and block need-1.
	start := w.alloc.end
	var blocks []int64 // table indices of the new blocks
	for nb := int64(0); ; {
		areaEnd := start + nb + tableClusters
		blocks = blocks[:0]
		seen := map[int64]bool{}
		for c := start; c < areaEnd; c++ {
			ti := c / w.alloc.ref.perBlock
			if !seen[ti] && (ti >= oldLen || w.alloc.reft.words[ti]&reftOffsetMask == 0) {
				seen[ti] = true
				blocks = append(blocks, ti)
			}
		}
		if ti := need - 1; !seen[ti] && (ti >= oldLen || w.alloc.reft.words[ti]&reftOffsetMask == 0) {
			blocks = append(blocks, ti)
		}
		if int64(len(blocks)) == nb {
			break
		}
		nb = int64(len(blocks))
	}
	nb := int64(len(blocks))
	tableStart := start + nb
	areaEnd := tableStart + tableClusters
	if err := w.soundBlocks(start, areaEnd); err != nil {
		return err
	}
	if err := w.host.reserveFile(areaEnd * cs); err != nil {
		return err
	}

	// The area's clusters that existing blocks count get their refcount
	// there; those blocks are written with the new ones, before the
	// switch.
	for c := start; c < areaEnd; c++ {
		if ti := c / w.alloc.ref.perBlock; ti < oldLen && w.alloc.reft.words[ti]&reftOffsetMask != 0 {
			if err := w.setRefcount(c, 1); err != nil {
				return err
			}
		}
	}
	newTable := make([]uint64, newLen)
	copy(newTable, w.alloc.reft.words)
	buf := make([]byte, cs)
	for k, ti := range blocks {
		bc := start + int64(k) // the block's cluster
		words := make([]uint64, cs/8)
		t := &table{words: words}
		for c := max(start, ti*w.alloc.ref.perBlock); c < min(areaEnd, (ti+1)*w.alloc.ref.perBlock); c++ {
			w.alloc.ref.put(t, c-ti*w.alloc.ref.perBlock, 1)
		}
		encodeWords(buf, words)
		if err := w.host.addMeta(bc*cs, cs, MetaRefcountBlock); err != nil {
			return err
		}
		if err := w.host.writeMeta(buf, bc*cs, MetaRefcountBlock); err != nil {
			return err
		}
		w.l.cache.unpin(w.l.cache.put(cacheKey{owner: l.owner, off: bc * cs}, words))
		newTable[ti] = uint64(bc * cs)
	}
	if err := w.writeRefblocks(); err != nil {
		return err
	}
	tb := make([]byte, newLen*8)
	encodeWords(tb, newTable)
	if err := w.host.addMeta(tableStart*cs, tableClusters*cs, MetaRefcountTable); err != nil {
		return err
	}
	if err := w.host.writeMeta(tb, tableStart*cs, MetaRefcountTable); err != nil {
		return err
	}
	if err := w.host.sync(); err != nil {
		return err
	}
	oldOff, oldClusters := w.alloc.reftOff, int64(len(w.alloc.reft.words))*8/cs
	if err := w.host.updateHeader(func(h []byte) {
		fieldRefcountTableOffset.put(h, uint64(tableStart*cs))
		fieldRefcountTableClusters.put(h, uint64(tableClusters))
	}); err != nil {
		return err
	}
	w.alloc.reftOff = tableStart * cs
	w.alloc.reft = &table{words: newTable}
	w.alloc.end = max(w.alloc.end, areaEnd)
	w.alloc.usedEnd = max(w.alloc.usedEnd, areaEnd)
	// The header no longer names the old table: its clusters are free.
	return w.releaseTable(oldOff, oldClusters*cs, MetaRefcountTable)
}
