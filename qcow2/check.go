package qcow2

import (
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
	// has one (qemu-img check prints them on stderr).
	Messages []string `json:"-"`
}

const (
	reftReserved   = 0x1ff
	checkTableBits = 32 // refcounts counted in uint32s
)

// checker holds the state of one check.
type checker struct {
	l        *layer
	res      *CheckResult
	refs     []uint32 // references counted per host cluster
	maxRef   uint64   // the image's largest refcount
	progress func(done, total int64)
	done     int64
	total    int64
	// buf and words are readCluster's, reused for every table: a check
	// reads thousands of them, and fresh buffers cost page faults.
	buf   []byte
	words []uint64
}

func (c *checker) errorf(format string, args ...any) {
	c.res.Corruptions++
	c.res.Messages = append(c.res.Messages, "ERROR "+fmt.Sprintf(format, args...))
}

func (c *checker) notef(format string, args ...any) {
	c.res.Messages = append(c.res.Messages, fmt.Sprintf(format, args...))
}

// Check checks the image's metadata like qemu-img check (of the image
// itself, not its backing files) and returns what it found. progress, if
// not nil, is called now and then with the L2 tables done so far and in
// all. An error means the check could not complete (qemu-img's exit
// status 1); problems in the image are in the result.
func (img *Image) Check(progress func(done, total int64)) (*CheckResult, error) {
	l := img.top
	cs := l.clusterSize()
	c := &checker{
		l:        l,
		res:      &CheckResult{Filename: l.name, Format: "qcow2"},
		refs:     make([]uint32, (l.fileSize+cs-1)/cs),
		maxRef:   min(uint64(1)<<(1<<l.hdr.RefcountOrder)-1, 1<<checkTableBits-1),
		progress: progress,
	}
	c.res.TotalClusters = int64((img.top.hdr.Size + uint64(cs) - 1) >> l.clusterBits)
	if err := c.run(); err != nil {
		return c.res, err
	}
	return c.res, nil
}

func (c *checker) run() error {
	l, h := c.l, c.l.hdr
	cs := l.clusterSize()

	// What the L2 tables to walk are, for progress.
	active, err := l.meta.words(int64(h.L1TableOffset), int64(h.L1Size), "L1 table")
	if err != nil {
		return err
	}
	snapL1s := make([][]uint64, len(l.snapshots))
	for i, s := range l.snapshots {
		if s.L1TableOffset%uint64(cs) == 0 && uint64(s.L1Size)*8 <= maxL1Bytes {
			if snapL1s[i], err = l.meta.words(int64(s.L1TableOffset), int64(s.L1Size), "snapshot L1 table"); err != nil {
				return err
			}
		}
	}
	for _, t := range append([][]uint64{active}, snapL1s...) {
		for _, e := range t {
			if e != 0 {
				c.total++
			}
		}
	}

	c.inc(0, cs) // the header
	if err := c.checkL1(active, int64(h.L1TableOffset), true); err != nil {
		return err
	}
	if l.external() && len(l.snapshots) > 0 {
		c.errorf("%d snapshots in image with data file", len(l.snapshots))
	}
	for i, s := range l.snapshots {
		if s.L1TableOffset%uint64(cs) != 0 {
			c.errorf("snapshot %s (%s) l1_offset=%#x: L1 table is not cluster aligned; snapshot table entry corrupted", s.ID, s.Name, s.L1TableOffset)
			continue
		}
		if err := c.checkL1(snapL1s[i], int64(s.L1TableOffset), false); err != nil {
			return err
		}
	}
	c.inc(int64(h.SnapshotsOffset), l.snapTableSize)
	c.inc(int64(h.RefcountTableOffset), int64(h.RefcountTableClusters)*cs)
	if err := c.checkBitmaps(); err != nil {
		return err
	}
	if err := c.checkRefblocks(); err != nil {
		return err
	}
	highest := c.compare()
	if err := c.checkCopied(active); err != nil {
		return err
	}
	c.res.ImageEndOffset = (highest + 1) * cs
	return nil
}

// inc counts a reference to every cluster of [off, off+size), like qemu's
// qcow2_inc_refcounts_imrt: a range ending a cluster or more past the end
// of the file is a corruption and is not counted (the last cluster may
// legitimately be cut short).
func (c *checker) inc(off, size int64) {
	if size <= 0 {
		return
	}
	cs := c.l.clusterSize()
	if off+size-c.l.fileSize >= cs {
		c.errorf("counting reference for region exceeding the end of the file by one cluster or more: offset %#x size %#x", off, size)
		return
	}
	for k := off >> c.l.clusterBits; k <= (off+size-1)>>c.l.clusterBits; k++ {
		if k >= int64(len(c.refs)) {
			c.refs = append(c.refs, make([]uint32, k+1-int64(len(c.refs)))...)
		}
		if uint64(c.refs[k]) >= c.maxRef {
			c.errorf("overflow cluster offset=%#x", k<<c.l.clusterBits)
			continue
		}
		c.refs[k]++
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
	n := max(0, min(int64(len(c.buf)), c.l.fileSize-off))
	if err := c.l.meta.read(c.buf[:n], off, "table"); err != nil {
		return nil, err
	}
	clear(c.buf[n:])
	decodeWords(c.words, c.buf)
	return c.words, nil
}

// checkL1 counts an L1 table and everything it references.
func (c *checker) checkL1(l1 []uint64, off int64, active bool) error {
	if len(l1) == 0 {
		return nil
	}
	cs := c.l.clusterSize()
	c.inc(off, int64(len(l1))*8)
	for _, e := range l1 {
		if e == 0 {
			continue
		}
		c.done++
		if c.progress != nil && c.done%64 == 0 {
			c.progress(c.done, c.total)
		}
		if l1Entry(e).reserved() != 0 {
			c.errorf("found L1 entry with reserved bits set: %x", e)
		}
		l2 := l1Entry(e).l2Offset()
		c.inc(l2, cs)
		if l2&(cs-1) != 0 {
			c.errorf("l2_offset=%x: Table is not cluster aligned; L1 entry corrupted", l2)
		}
		if err := c.checkL2(l2, active); err != nil {
			return err
		}
	}
	return nil
}

// checkL2 counts one L2 table's clusters, gathering cluster statistics for
// the active table, as qemu's check_refcounts_l2.
func (c *checker) checkL2(off int64, active bool) error {
	l := c.l
	cs := l.clusterSize()
	t, err := c.readCluster(off)
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
			c.errorf("found l2 entry with reserved bits set: %x", e.word)
		}
		offset := e.word & l2OffsetMask
		allocated := e.allocated(l.external())
		switch {
		case compressed:
			if e.copied() {
				coff, _ := l.compressedRange(l2Entry{word: e.word &^ oflagCopied})
				c.errorf("coffset=%#x: copied flag must never be set for compressed clusters", coff)
				e.word &^= oflagCopied
			}
			if l.external() {
				c.errorf("compressed cluster %d with data file, entry=%#x", i/words, e.word)
				continue
			}
			if e.bitmap != 0 {
				c.errorf("compressed cluster %d with non-zero subcluster allocation bitmap, entry=%#x", i/words, e.word)
				continue
			}
			coff, csize := l.compressedRange(e)
			c.inc(coff, csize)
			if active {
				c.res.AllocatedClusters++
				c.res.CompressedClusters++
				c.res.FragmentedClusters++
			}
		case allocated && (l.extendedL2 || e.word&oflagZero == 0 || offset != 0):
			// Normal, or preallocated zero.
			if (e.bitmap>>32)&e.bitmap != 0 {
				c.errorf("offset=%x: Allocated cluster has corrupted subcluster allocation bitmap", offset)
			}
			if int64(offset)&(cs-1) != 0 {
				hasData := e.word&oflagZero == 0
				if l.extendedL2 {
					hasData = e.bitmap&subclusterAllocMask != 0
				}
				if hasData {
					c.errorf("offset=%x: Data cluster is not properly aligned; L2 entry corrupted.", offset)
				} else {
					c.errorf("offset=%x: Preallocated cluster is not properly aligned; L2 entry corrupted.", offset)
				}
			}
			if active {
				c.res.AllocatedClusters++
				if nextContiguous != 0 && int64(offset) != nextContiguous {
					c.res.FragmentedClusters++
				}
				nextContiguous = int64(offset) + cs
			}
			if !l.external() {
				c.inc(int64(offset), cs)
				if mm, err := l.metadata(); err == nil {
					if r, ok := mm.Overlap(int64(offset), int64(offset)+cs); ok {
						c.notef("data cluster at %#x (L2 table at %#x, entry %d) overlaps the %s at %#x", offset, off, i/words, r.Kind, r.Start)
					}
				}
			}
		case !allocated && e.bitmap&subclusterAllocMask != 0:
			c.errorf("Unallocated cluster has non-zero subcluster allocation bitmap, entry=%#x", e.word)
		}
	}
	return nil
}

// checkBitmaps counts the bitmap directory, tables and data clusters.
func (c *checker) checkBitmaps() error {
	err := c.l.addBitmaps(func(start, length int64, _ MetaKind) { c.inc(start, length) }, false)
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
	nb := (c.l.fileSize + cs - 1) / cs
	for i, e := range table {
		off := int64(e & reftOffsetMask)
		if e&reftReserved != 0 {
			c.errorf("refcount table entry %d has reserved bits set", i)
			continue
		}
		if off&(cs-1) != 0 {
			c.errorf("refcount block %d is not cluster aligned; refcount table entry corrupted", i)
			continue
		}
		if off>>c.l.clusterBits >= nb {
			c.errorf("refcount block %d is outside image", i)
			continue
		}
		if off != 0 {
			c.inc(off, cs)
			if n := c.refs[off>>c.l.clusterBits]; n != 1 {
				c.errorf("refcount block %d refcount=%d", i, n)
			}
		}
	}
	return nil
}

// compare compares stored refcounts with the counted references and
// returns the highest cluster in use.
func (c *checker) compare() int64 {
	var highest int64
	for i := range c.refs {
		stored, err := c.l.refcount(int64(i))
		if err != nil {
			c.res.CheckErrors++
			c.notef("Can't get refcount for cluster %d: %v", i, err)
			continue
		}
		counted := uint64(c.refs[i])
		if stored > 0 || counted > 0 {
			highest = int64(i)
		}
		switch {
		case stored < counted:
			c.res.Corruptions++
			c.notef("ERROR cluster %d refcount=%d reference=%d", i, stored, counted)
		case stored > counted:
			c.res.Leaks++
			c.notef("Leaked cluster %d refcount=%d reference=%d", i, stored, counted)
		}
	}
	return highest
}

// checkCopied checks the COPIED flags of the active tables against the
// refcounts: set exactly when the refcount is 1.
func (c *checker) checkCopied(active []uint64) error {
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
			c.errorf("OFLAG_COPIED L2 cluster: l1_index=%d l1_entry=%x refcount=%d", i, e, rc)
		}
		t, err := c.readCluster(l2)
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
				c.errorf("OFLAG_COPIED data cluster: l2_entry=%x refcount=%d", e.word, rc)
			}
		}
	}
	return nil
}
