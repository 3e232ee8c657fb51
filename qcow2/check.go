package qcow2

import (
	"context"
	"fmt"
)

// The image check: qemu-img check without repairs.
//
// Every reference to a host cluster is counted (the header, the active L1
// table and its L2 tables and data clusters, every snapshot's L1 and L2
// tables and data clusters, the snapshot table, the refcount table and
// blocks, the bitmaps), and the counts are compared with the stored
// refcounts: a stored refcount above the count is a leak, one below it a
// corruption. Malformed entries (reserved bits, unaligned offsets,
// references past the end of the file) and COPIED flags that disagree with
// refcounts are corruptions, with the same counting rules as qemu's
// block/qcow2-refcount.c, so the numbers agree with qemu-img check. The
// image is never written.
//
// Unlike qemu, the work and memory are bounded by what the image holds,
// not by the size of its file: references are counted in pages allocated
// where references fall (check_counts.go), so a file extended sparsely to
// terabytes costs what its metadata costs; an L2 table that many L1
// entries name is walked once and its references counted as many times as
// it is named; refcount blocks that nothing references are summed once per
// distinct block. Everything the check holds is charged to the memory
// budget, and it stops when its context is done.

// CheckResult has the fields of `qemu-img check --output=json`.
type CheckResult struct {
	Filename           string `json:"filename"`
	Format             string `json:"format"`
	CheckErrors        int64  `json:"check-errors"`
	Corruptions        int64  `json:"corruptions,omitempty"`
	Leaks              int64  `json:"leaks,omitempty"`
	ImageEndOffset     int64  `json:"image-end-offset,omitempty"`
	TotalClusters      int64  `json:"total-clusters,omitempty"`
	AllocatedClusters  int64  `json:"allocated-clusters,omitempty"`
	FragmentedClusters int64  `json:"fragmented-clusters,omitempty"`
	CompressedClusters int64  `json:"compressed-clusters,omitempty"`
	// Messages describe each problem found, in qemu's wording where it
	// has one (qemu-img check prints them on stderr), the first
	// maxCheckMessages of them.
	Messages []string `json:"-"`
}

// overflowAdvice is the line qemu prints after each refcount overflow.
const overflowAdvice = "Use qemu-img amend to increase the refcount entry width or qemu-img convert to create a clean copy if the image cannot be opened for writing"

const (
	reftReserved   = 0x1ff
	checkTableBits = 32 // refcounts counted in uint32s
	// maxCheckMessages bounds Messages; further problems are counted,
	// and summed up in one last message.
	maxCheckMessages = 10000
)

// checker holds the state of one check.
type checker struct {
	ctx      context.Context
	l        *layer
	res      *CheckResult
	refs     *counters // references counted per host cluster
	maxRef   uint64    // the image's largest refcount
	progress func(done, total int64)
	done     int64
	total    int64
	unlisted int64 // problems beyond maxCheckMessages
	// buf and words are readCluster's, reused for every table: a check
	// reads thousands of them, and fresh buffers cost page faults.
	buf   []byte
	words []uint64
}

func (c *checker) message(m string) {
	if len(c.res.Messages) < maxCheckMessages {
		c.res.Messages = append(c.res.Messages, m)
	} else {
		c.unlisted++
	}
}

// errorfN counts n corruptions of one kind, listing the first. The
// format is qemu's message, with its "ERROR " or "ERROR: " (qemu
// 7.2's block/qcow2-refcount.c uses both).
func (c *checker) errorfN(n int64, format string, args ...any) {
	if n <= 0 {
		return
	}
	c.res.Corruptions += n
	m := fmt.Sprintf(format, args...)
	for ; n > 0 && len(c.res.Messages) < maxCheckMessages; n-- {
		c.res.Messages = append(c.res.Messages, m)
	}
	c.unlisted += n
}

func (c *checker) errorf(format string, args ...any) { c.errorfN(1, format, args...) }

func (c *checker) notef(format string, args ...any) { c.message(fmt.Sprintf(format, args...)) }

// Check checks the image's metadata like qemu-img check (of the image
// itself, not its backing files) and returns what it found. progress, if
// not nil, is called now and then with the L2 tables done so far and in
// all. An error means the check could not complete (qemu-img's exit status
// 1); problems in the image are in the result. It stops with ctx's error
// when ctx is done.
func (img *Image) Check(ctx context.Context, progress func(done, total int64)) (*CheckResult, error) {
	l := img.top
	cs := l.clusterSize()
	c := &checker{
		ctx:      ctx,
		l:        l,
		res:      &CheckResult{Filename: l.name, Format: "qcow2"},
		refs:     newCounters(l.budget),
		maxRef:   min(uint64(1)<<(1<<l.hdr.RefcountOrder)-1, 1<<checkTableBits-1),
		progress: progress,
	}
	defer c.refs.free()
	c.res.TotalClusters = (virtualSize(l.hdr.Size) + cs - 1) >> l.clusterBits
	err := c.run()
	if err == nil {
		err = c.refs.err
	}
	if c.unlisted > 0 {
		c.res.Messages = append(c.res.Messages, fmt.Sprintf("... and %d more problems, not listed", c.unlisted))
	}
	return c.res, err
}

// l2Use is how often the L1 tables name one L2 table: from the active
// table (whose clusters are counted in the statistics) and in all.
type l2Use struct {
	off           int64
	active, total int64
}

// l2Uses collects the L2 tables the L1 tables name, in the order they are
// first named, each once.
type l2Uses struct {
	order []*l2Use
	byOff map[int64]*l2Use
}

// l2UseBytes is what one distinct L2 table costs the check in memory.
const l2UseBytes = 96

func (c *checker) run() error {
	l, h := c.l, c.l.hdr
	cs := l.clusterSize()

	// The L1 tables: the active one and every snapshot's, read as qemu
	// reads them (past the end of the file as zeros).
	active, err := c.readL1(int64(h.L1TableOffset), int64(h.L1Size), "L1 table")
	if err != nil {
		return err
	}
	defer l.budget.sub(int64(len(active)) * 8)

	uses := &l2Uses{byOff: map[int64]*l2Use{}}
	defer func() { l.budget.sub(int64(len(uses.order)) * l2UseBytes) }()
	c.inc(0, cs) // the header
	if err := c.checkL1(uses, active, int64(h.L1TableOffset), true); err != nil {
		return err
	}
	if l.external() && len(l.snapshots) > 0 {
		c.errorf("ERROR %d snapshots in image with data file", len(l.snapshots))
	}
	var snapRead int64
	for _, s := range l.snapshots {
		if s.L1TableOffset%uint64(cs) != 0 {
			c.errorf("ERROR snapshot %s (%s) l1_offset=%#x: L1 table is not cluster aligned; snapshot table entry corrupted", s.ID, s.Name, s.L1TableOffset)
			continue
		}
		if uint64(s.L1Size)*8 > maxL1Bytes {
			c.errorf("ERROR snapshot %s (%s) l1_size=%#x: L1 table is too large; snapshot table entry corrupted", s.ID, s.Name, s.L1Size)
			continue
		}
		if snapRead += int64(s.L1Size) * 8; snapRead > maxMapTableBytes {
			return fmt.Errorf("%s: the snapshots' L1 tables hold more than %d bytes: %w", l.name, maxMapTableBytes, ErrCorrupt)
		}
		t, err := c.readL1(int64(s.L1TableOffset), int64(s.L1Size), "snapshot L1 table")
		if err != nil {
			return err
		}
		err = c.checkL1(uses, t, int64(s.L1TableOffset), false)
		l.budget.sub(int64(len(t)) * 8)
		if err != nil {
			return err
		}
	}
	// Every distinct L2 table once, its references counted as often as
	// the L1 tables name it.
	c.total = int64(len(uses.order))
	for _, u := range uses.order {
		if err := c.ctx.Err(); err != nil {
			return err
		}
		c.done++
		if c.progress != nil && c.done%64 == 0 {
			c.progress(c.done, c.total)
		}
		if err := c.checkL2(u); err != nil {
			return err
		}
	}
	c.inc(int64(h.SnapshotsOffset), l.snapTableSize)
	c.inc(int64(h.RefcountTableOffset), int64(h.RefcountTableClusters)*cs)
	if h.CryptMethod == cryptLUKS {
		c.inc(int64(h.CryptoHeaderOffset), int64(h.CryptoHeaderLength))
	}
	if err := c.checkBitmaps(); err != nil {
		return err
	}
	if err := c.checkRefblocks(); err != nil {
		return err
	}
	highest, err := c.compare()
	if err != nil {
		return err
	}
	if err := c.checkCopied(uses, active); err != nil {
		return err
	}
	c.res.ImageEndOffset = (highest + 1) * cs
	return nil
}

// readL1 reads an L1 table of n entries at off, charged to the budget;
// like qemu's reads, what lies past the end of the file reads as zeros.
func (c *checker) readL1(off, n int64, what string) ([]uint64, error) {
	l := c.l
	if err := l.budget.add(n*8, what); err != nil {
		return nil, err
	}
	t := make([]uint64, n)
	inFile := max(0, min(n, (l.fsize()-off)/8))
	if inFile > 0 {
		buf := make([]byte, inFile*8)
		if err := l.meta.read(buf, off, what); err != nil {
			l.budget.sub(n * 8)
			return nil, err
		}
		decodeWords(t[:inFile], buf)
	}
	return t, nil
}

// inc counts a reference to every cluster of [off, off+size).
func (c *checker) inc(off, size int64) { c.incN(off, size, 1) }

// incN counts n references to every cluster of [off, off+size), like n
// calls of qemu's qcow2_inc_refcounts_imrt: a range ending a cluster or
// more past the end of the file is a corruption and is not counted (the
// last cluster may legitimately be cut short).
func (c *checker) incN(off, size, n int64) {
	if size <= 0 || n <= 0 {
		return
	}
	cs := c.l.clusterSize()
	if off < 0 || off > c.l.fsize() || size-(c.l.fsize()-off) >= cs {
		c.errorfN(n, "ERROR: counting reference for region exceeding the end of the file by one cluster or more: offset %#x size %#x", off, size)
		return
	}
	for k := off >> c.l.clusterBits; k <= (off+size-1)>>c.l.clusterBits; k++ {
		if over := c.refs.add(k, n, c.maxRef); over > 0 {
			c.errorfN(over, "ERROR: overflow cluster offset=%#x\n"+overflowAdvice, k<<c.l.clusterBits)
		}
	}
}

// readCluster reads one cluster as big-endian words; like qemu's reads,
// bytes past the end of the file (as it was at open) read as zeros. The
// words are valid until the next call.
func (c *checker) readCluster(off int64) ([]uint64, error) {
	if c.buf == nil {
		c.buf = make([]byte, c.l.clusterSize())
		c.words = make([]uint64, len(c.buf)/8)
	}
	n := max(0, min(int64(len(c.buf)), c.l.fsize()-off))
	if err := c.l.meta.read(c.buf[:n], off, "table"); err != nil {
		return nil, err
	}
	clear(c.buf[n:])
	decodeWords(c.words, c.buf)
	return c.words, nil
}

// checkL1 counts an L1 table and checks its entries; the L2 tables it
// names are noted in uses, to be walked once each.
func (c *checker) checkL1(uses *l2Uses, l1 []uint64, off int64, active bool) error {
	if len(l1) == 0 {
		return nil
	}
	cs := c.l.clusterSize()
	c.inc(off, int64(len(l1))*8)
	for _, e := range l1 {
		if e == 0 {
			continue
		}
		if l1Entry(e).reserved() != 0 {
			c.errorf("ERROR found L1 entry with reserved bits set: %x", e)
		}
		l2 := l1Entry(e).l2Offset()
		if l2&(cs-1) != 0 {
			c.errorf("ERROR l2_offset=%x: Table is not cluster aligned; L1 entry corrupted", l2)
		}
		u := uses.byOff[l2]
		if u == nil {
			if err := c.l.budget.add(l2UseBytes, "image check"); err != nil {
				return err
			}
			u = &l2Use{off: l2}
			uses.byOff[l2] = u
			uses.order = append(uses.order, u)
		}
		u.total++
		if active {
			u.active++
		}
	}
	return nil
}

// checkL2 counts one L2 table's clusters, as qemu's check_refcounts_l2
// does each time an L1 entry names the table: u.total times, the
// statistics u.active times.
func (c *checker) checkL2(u *l2Use) error {
	l := c.l
	cs := l.clusterSize()
	n, act := u.total, u.active
	c.incN(u.off, cs, n) // the table itself
	t, err := c.readCluster(u.off)
	if err != nil {
		c.res.CheckErrors++
		c.notef("ERROR: I/O error in check_refcounts_l2: %v", err)
		return err
	}
	words := l.l2EntryWords()
	var nextContiguous int64
	for i := 0; i+words <= len(t); i += words {
		e := l2Entry{word: t[i]}
		if words == 2 {
			e.bitmap = t[i+1]
		}
		compressed := e.compressed()
		if !compressed && e.word&l2StdReserved != 0 {
			c.errorfN(n, "ERROR found l2 entry with reserved bits set: %x", e.word)
		}
		offset := e.word & l2OffsetMask
		allocated := e.allocated(l.external())
		switch {
		case compressed:
			if e.copied() {
				coff, _ := l.compressedRange(l2Entry{word: e.word &^ oflagCopied})
				c.errorfN(n, "ERROR: coffset=%#x: copied flag must never be set for compressed clusters", coff)
				e.word &^= oflagCopied
			}
			if l.external() {
				c.errorfN(n, "ERROR compressed cluster %d with data file, entry=%#x", i/words, e.word)
				continue
			}
			if e.bitmap != 0 {
				c.errorfN(n, "ERROR compressed cluster %d with non-zero subcluster allocation bitmap, entry=%#x", i/words, e.word)
				continue
			}
			coff, csize := l.compressedRange(e)
			c.incN(coff, csize, n)
			c.res.AllocatedClusters += act
			c.res.CompressedClusters += act
			c.res.FragmentedClusters += act
		case allocated && (l.extendedL2 || e.word&oflagZero == 0 || offset != 0):
			// Normal, or preallocated zero.
			if (e.bitmap>>32)&e.bitmap != 0 {
				c.errorfN(n, "ERROR offset=%x: Allocated cluster has corrupted subcluster allocation bitmap", offset)
			}
			if int64(offset)&(cs-1) != 0 {
				hasData := e.word&oflagZero == 0
				if l.extendedL2 {
					hasData = e.bitmap&subclusterAllocMask != 0
				}
				if hasData {
					c.errorfN(n, "ERROR offset=%x: Data cluster is not properly aligned; L2 entry corrupted.", offset)
				} else {
					c.errorfN(n, "ERROR offset=%x: Preallocated cluster is not properly aligned; L2 entry corrupted.", offset)
				}
			}
			if act > 0 {
				c.res.AllocatedClusters += act
				if nextContiguous != 0 && int64(offset) != nextContiguous {
					c.res.FragmentedClusters += act
				}
				nextContiguous = int64(offset) + cs
			}
			if !l.external() {
				c.incN(int64(offset), cs, n)
			}
		case !allocated && e.bitmap&subclusterAllocMask != 0:
			c.errorfN(n, "ERROR: Unallocated cluster has non-zero subcluster allocation map")
		}
	}
	return nil
}

// checkBitmaps counts the bitmap directory, tables and data clusters.
func (c *checker) checkBitmaps() error {
	err := c.l.addBitmaps(func(start, length int64, _ MetaKind, times int64) { c.incN(start, length, times) }, false)
	if err != nil {
		c.res.CheckErrors++
		c.notef("ERROR: %v", err)
	}
	return nil
}

// checkRefblocks counts the refcount blocks, as qemu's check_refblocks.
func (c *checker) checkRefblocks() error {
	table, err := c.l.refcountTable()
	if err != nil {
		c.res.CheckErrors++
		return err
	}
	cs := c.l.clusterSize()
	nb := (c.l.fsize() + cs - 1) / cs
	for i, e := range table {
		off := int64(e & reftOffsetMask)
		if e&reftReserved != 0 {
			c.errorf("ERROR refcount table entry %d has reserved bits set", i)
			continue
		}
		if off&(cs-1) != 0 {
			c.errorf("ERROR refcount block %d is not cluster aligned; refcount table entry corrupted", i)
			continue
		}
		if off>>c.l.clusterBits >= nb {
			c.errorf("ERROR refcount block %d is outside image", i)
			continue
		}
		if off != 0 {
			c.inc(off, cs)
			if n := c.refs.get(off >> c.l.clusterBits); n != 1 {
				c.errorf("ERROR refcount block %d refcount=%d", i, n)
			}
		}
	}
	return nil
}

// blockSummary is what a refcount block holds over its first limit
// entries: how many are not zero, and the last of those (-1: none).
type blockSummary struct {
	nonzero, last int64
}

// compare compares stored refcounts with the counted references, in
// cluster order, and returns the highest cluster in use. Clusters are
// those of the file, and any beyond it that a reference names; a cluster
// that a refcount block covers is compared one by one only if some
// reference falls in its block (or problems are still being listed),
// else the block's non-zero entries are leaks, summed once per distinct
// block.
func (c *checker) compare() (int64, error) {
	l := c.l
	cs := l.clusterSize()
	width := int64(1) << l.hdr.RefcountOrder
	perBlock := cs * 8 / width
	end := max((l.fsize()+cs-1)/cs, c.refs.end())
	table, err := l.refcountTable()
	if err != nil {
		return 0, err
	}
	highest := int64(0)
	summaries := map[[2]int64]blockSummary{}

	// counted compares the clusters of [from, to) that have references
	// and no refcount block: each is a corruption.
	counted := func(from, to int64) {
		c.refs.each(from, to, func(k int64, n uint64) {
			highest = k
			c.res.Corruptions++
			c.notef("ERROR cluster %d refcount=%d reference=%d", k, 0, n)
		})
	}
	pos := int64(0)
	for ti := int64(0); ti < int64(len(table)) && ti*perBlock < end; ti++ {
		if ti&1023 == 0 {
			if err := c.ctx.Err(); err != nil {
				return 0, err
			}
		}
		start := ti * perBlock
		limit := min(perBlock, end-start)
		words, off, err := l.refcountBlock(ti)
		if words == nil && err == nil {
			continue // no block: counted below, with the gaps
		}
		counted(pos, start)
		pos = start + limit
		if err != nil {
			// Every cluster of the block: refcount unknown.
			c.res.CheckErrors += limit
			c.notef("Can't get refcount for clusters %d to %d: %v", start, start+limit-1, err)
			continue
		}
		if !c.refs.any(start, start+limit) {
			// Nothing references this block's clusters: its
			// non-zero entries are leaks, summed once per distinct
			// block (listed one by one while problems are listed).
			key := [2]int64{off, limit}
			s, ok := summaries[key]
			if !ok {
				s = blockSummary{last: -1}
				for i := int64(0); i < limit; i++ {
					if blockRefcount(words, i, width) != 0 {
						s.nonzero++
						s.last = i
					}
				}
				summaries[key] = s
			}
			if s.nonzero == 0 {
				continue
			}
			highest = start + s.last
			if len(c.res.Messages) >= maxCheckMessages {
				c.res.Leaks += s.nonzero
				c.unlisted += s.nonzero
				continue
			}
		}
		for i := int64(0); i < limit; i++ {
			k := start + i
			stored := blockRefcount(words, i, width)
			n := c.refs.get(k)
			if stored > 0 || n > 0 {
				highest = k
			}
			switch {
			case stored < n:
				c.res.Corruptions++
				c.notef("ERROR cluster %d refcount=%d reference=%d", k, stored, n)
			case stored > n:
				c.res.Leaks++
				c.notef("Leaked cluster %d refcount=%d reference=%d", k, stored, n)
			}
		}
	}
	counted(pos, end)
	return highest, nil
}

// checkCopied checks the COPIED flags of the active tables against the
// refcounts: set exactly when the refcount is 1. Each distinct L2 table is
// read once; what it gets wrong counts as often as the active L1 table
// names it.
func (c *checker) checkCopied(uses *l2Uses, active []uint64) error {
	l := c.l
	for i, e := range active {
		l2 := l1Entry(e).l2Offset()
		if l2 == 0 {
			continue
		}
		rc, err := l.refcount(l2 >> l.clusterBits)
		if err != nil {
			continue
		}
		if (rc == 1) != l1Entry(e).copied() {
			c.errorf("ERROR OFLAG_COPIED L2 cluster: l1_index=%d l1_entry=%x refcount=%d", i, e, rc)
		}
	}
	for _, u := range uses.order {
		if u.active == 0 || u.off == 0 {
			continue
		}
		if _, err := l.refcount(u.off >> l.clusterBits); err != nil {
			continue
		}
		if err := c.ctx.Err(); err != nil {
			return err
		}
		t, err := c.readCluster(u.off)
		if err != nil {
			c.res.CheckErrors++
			c.notef("ERROR: Could not read L2 table: %v", err)
			return err
		}
		words := l.l2EntryWords()
		for j := 0; j+words <= len(t); j += words {
			e := l2Entry{word: t[j]}
			off := e.hostOffset()
			if e.compressed() {
				continue
			}
			if !e.allocated(l.external()) || (!l.extendedL2 && e.word&oflagZero != 0 && off == 0) {
				continue
			}
			rc := uint64(1)
			if !l.external() {
				if rc, err = l.refcount(off >> l.clusterBits); err != nil {
					continue
				}
			}
			if (rc == 1) != e.copied() {
				c.errorfN(u.active, "ERROR OFLAG_COPIED data cluster: l2_entry=%x refcount=%d", e.word, rc)
			}
		}
	}
	return nil
}
