package qcow2

import (
	"fmt"
	"sort"
	"strings"
)

// The metadata map: every host cluster of an image file that holds
// metadata, with the kinds of metadata that claim it, as a sorted list of
// disjoint ranges with an O(log n) overlap query. The read path asks it
// whether a data or compressed cluster points into metadata (corruption:
// the read fails instead of handing metadata to the guest), the writer
// checks every host write, free and punch against it, and the image check
// uses it to report overlaps.
//
// Ranges are whole clusters, as qemu's overlap checks widen every
// metadata range (qcow2_check_metadata_overlap): an L1 table of one
// entry claims its whole cluster, so a data cluster pointed into the rest
// of it is an overlap too. A cluster claimed by two kinds of tables (an L1
// entry naming the refcount table as an L2 table) keeps both kinds: it is
// itself an overlap, and any write of one of them there is refused.
//
// It is built when the image opens, from what the image already says: the
// header cluster, the L1 table and the L2 tables its entries name, the
// refcount table and blocks, the snapshot table with every snapshot's L1
// table and L2 tables, and the bitmap directory, tables and data clusters.
// An image whose map cannot be built is refused: without it, nothing would
// stop an L2 entry from serving metadata as guest data. Building reads the
// refcount table, the snapshot L1 tables and the bitmap tables, never an L2
// table; each table is read once however many entries name it, the tables
// read are bounded (maxMapTableBytes) and every byte held is charged to the
// memory budget. Memory is 24 bytes per range after merging adjacent ranges
// of the same kinds: the builder merges as it goes, so tables that name the
// same clusters over and over cost no more than the distinct ranges.

// MetaKind is a kind of metadata.
type MetaKind uint8

const (
	MetaHeader MetaKind = iota + 1
	MetaL1
	MetaL2
	MetaRefcountTable
	MetaRefcountBlock
	MetaSnapshotTable
	MetaSnapshotL1
	MetaSnapshotL2
	MetaBitmapDirectory
	MetaBitmapTable
	MetaBitmapData
	MetaCryptoHeader
)

var metaNames = [...]string{"", "header", "L1 table", "L2 table", "refcount table", "refcount block",
	"snapshot table", "snapshot L1 table", "snapshot L2 table", "bitmap directory", "bitmap table", "bitmap data", "crypto header"}

func (k MetaKind) String() string {
	if int(k) < len(metaNames) {
		return metaNames[k]
	}
	return "metadata"
}

// MetaKinds is a set of kinds of metadata.
type MetaKinds uint16

// Kinds returns the set holding the given kinds.
func Kinds(ks ...MetaKind) MetaKinds {
	var s MetaKinds
	for _, k := range ks {
		s |= 1 << k
	}
	return s
}

// Has reports whether k is in the set.
func (s MetaKinds) Has(k MetaKind) bool { return s&(1<<k) != 0 }

// String names the kinds: "L2 table", "L2 table and refcount table".
func (s MetaKinds) String() string {
	var names []string
	for k := MetaHeader; int(k) < len(metaNames); k++ {
		if s.Has(k) {
			names = append(names, k.String())
		}
	}
	switch len(names) {
	case 0:
		return "no metadata"
	case 1:
		return names[0]
	}
	return strings.Join(names[:len(names)-1], ", ") + " and " + names[len(names)-1]
}

// MetaRange is a host range [Start, End) of whole clusters holding
// metadata of the kinds Kinds.
type MetaRange struct {
	Start, End int64
	Kinds      MetaKinds
}

// MetadataMap is the sorted, disjoint list of an image file's metadata
// clusters. A map is never changed once published: the writer publishes a
// new one (with, without) when it allocates or frees metadata, and readers
// keep whatever map they loaded.
type MetadataMap struct {
	ranges      []MetaRange
	clusterBits uint
}

// Overlap returns the first metadata range overlapping [start, end), if
// any, in O(log n).
func (m *MetadataMap) Overlap(start, end int64) (MetaRange, bool) {
	r := m.ranges
	i := sort.Search(len(r), func(i int) bool { return r[i].End > start })
	if i < len(r) && r[i].Start < end {
		return r[i], true
	}
	return MetaRange{}, false
}

// Ranges returns the map's ranges, sorted. They must not be modified.
func (m *MetadataMap) Ranges() []MetaRange { return m.ranges }

// conflict returns the first metadata range overlapping [start, end) that
// holds a kind not in allowed: guest data (allowed: none) must not land
// on any metadata, an L2 table (allowed: L2) not on a cluster that also
// holds a refcount block.
func (m *MetadataMap) conflict(start, end int64, allowed MetaKinds) (MetaRange, bool) {
	r := m.ranges
	for i := sort.Search(len(r), func(i int) bool { return r[i].End > start }); i < len(r) && r[i].Start < end; i++ {
		if r[i].Kinds&^allowed != 0 {
			return r[i], true
		}
	}
	return MetaRange{}, false
}

// widen rounds [start, end) out to whole clusters.
func (m *MetadataMap) widen(start, end int64) (int64, int64) {
	cs := int64(1) << m.clusterBits
	return start &^ (cs - 1), (end + cs - 1) &^ (cs - 1)
}

// with returns a copy of the map in which the clusters of [start, end)
// hold kind too.
func (m *MetadataMap) with(start, end int64, kind MetaKind) *MetadataMap {
	return m.update(start, end, func(s MetaKinds) MetaKinds { return s | Kinds(kind) })
}

// without returns a copy of the map in which the clusters of [start, end)
// no longer hold kind.
func (m *MetadataMap) without(start, end int64, kind MetaKind) *MetadataMap {
	return m.update(start, end, func(s MetaKinds) MetaKinds { return s &^ Kinds(kind) })
}

// update returns a copy of the map with f applied to the kinds of every
// cluster of [start, end) (widened to whole clusters), empty ranges
// dropped and touching ranges of the same kinds merged. The copy costs
// O(n): metadata is allocated a cluster at a time, seldom compared with
// data (one L2 table per 512 MiB of guest disk at the default cluster
// size).
func (m *MetadataMap) update(start, end int64, f func(MetaKinds) MetaKinds) *MetadataMap {
	start, end = m.widen(start, end)
	r := m.ranges
	i := sort.Search(len(r), func(i int) bool { return r[i].End > start })
	out := make([]MetaRange, 0, len(r)+3)
	out = append(out, r[:i]...)
	add := func(x MetaRange) {
		if x.Start >= x.End || x.Kinds == 0 {
			return
		}
		if n := len(out); n > 0 && out[n-1].End == x.Start && out[n-1].Kinds == x.Kinds {
			out[n-1].End = x.End
			return
		}
		out = append(out, x)
	}
	pos := start
	j := i
	for ; j < len(r) && r[j].Start < end; j++ {
		x := r[j]
		if x.Start < start {
			add(MetaRange{x.Start, start, x.Kinds})
		}
		if pos < x.Start {
			add(MetaRange{pos, x.Start, f(0)}) // a gap
		}
		a := max(x.Start, start)
		b := min(x.End, end)
		add(MetaRange{a, b, f(x.Kinds)})
		pos = b
		if x.End > end {
			add(MetaRange{end, x.End, x.Kinds})
		}
	}
	if pos < end {
		add(MetaRange{pos, end, f(0)})
	}
	for ; j < len(r); j++ {
		add(r[j])
	}
	return &MetadataMap{ranges: out, clusterBits: m.clusterBits}
}

// metaBuilder collects ranges, then sorts and merges them. With a charge,
// the memory of its ranges is charged to it, and it merges what it has
// whenever its buffer is full, growing it only when merging frees less
// than half; the first charge that fails is kept in err and ends the
// collecting.
type metaBuilder struct {
	clusterBits uint
	ranges      []MetaRange
	charge      *charge // nil: no budget (tests, the check's counting)
	held        int64   // bytes charged for ranges' buffer
	err         error
}

// metaRangeBytes is the memory of one MetaRange.
const metaRangeBytes = 24

// add records length bytes at start as metadata of kind k: the clusters
// they touch.
func (b *metaBuilder) add(start, length int64, k MetaKind) {
	if length <= 0 || b.err != nil {
		return
	}
	if b.charge != nil && len(b.ranges) == cap(b.ranges) {
		b.grow()
		if b.err != nil {
			return
		}
	}
	cs := int64(1) << b.clusterBits
	b.ranges = append(b.ranges, MetaRange{start &^ (cs - 1), (start + length + cs - 1) &^ (cs - 1), Kinds(k)})
}

// grow makes room for more ranges: by merging those it has, or by a
// larger buffer, charged first.
func (b *metaBuilder) grow() {
	if n := len(b.ranges); n >= 1024 {
		b.ranges = b.merge(b.ranges)
		if len(b.ranges) <= n/2 {
			return
		}
	}
	newCap := max(1024, 2*len(b.ranges))
	need := int64(newCap) * metaRangeBytes
	if err := b.charge.add(need, "metadata map"); err != nil {
		b.err = err
		return
	}
	r := make([]MetaRange, len(b.ranges), newCap)
	copy(r, b.ranges)
	b.ranges = r
	b.charge.sub(b.held)
	b.held = need
}

// merge merges r (see mergeRanges), charging a buffer that merging
// overlapping kinds had to allocate.
func (b *metaBuilder) merge(r []MetaRange) []MetaRange {
	out := mergeRanges(r)
	if b.charge != nil && cap(out) != cap(r) {
		need := int64(cap(out)) * metaRangeBytes
		if err := b.charge.add(need, "metadata map"); err != nil && b.err == nil {
			b.err = err
		}
		b.charge.sub(b.held)
		b.held = need
	}
	return out
}

// build sorts the ranges and merges them into the map.
func (b *metaBuilder) build() *MetadataMap {
	r := b.merge(b.ranges)
	if b.charge != nil && cap(r) > 2*len(r)+1024 {
		// Keep only what the map needs.
		exact := make([]MetaRange, len(r))
		copy(exact, r)
		r = exact
		b.charge.sub(b.held - int64(cap(r))*metaRangeBytes)
		b.held = int64(cap(r)) * metaRangeBytes
	}
	return &MetadataMap{ranges: r, clusterBits: b.clusterBits}
}

// mergeRanges sorts r and merges it into disjoint ranges, touching ranges
// of the same kinds merged, the kinds of overlapping ones joined. Images
// qemu made have no overlaps between kinds, and are merged in place; a
// damaged one is merged into a new slice.
func mergeRanges(r []MetaRange) []MetaRange {
	sort.Slice(r, func(i, j int) bool { return r[i].Start < r[j].Start })
	out := r[:0]
	for i, x := range r {
		n := len(out)
		if n > 0 && x.Start <= out[n-1].End && x.Kinds == out[n-1].Kinds {
			out[n-1].End = max(out[n-1].End, x.End)
			continue
		}
		if n > 0 && x.Start < out[n-1].End {
			// Kinds overlap: out and the rest of r still cover
			// what r covered.
			return sweepRanges(append(append([]MetaRange(nil), out...), r[i:]...))
		}
		out = append(out, x)
	}
	return out
}

// sweepRanges makes disjoint ranges of overlapping ones, each holding the
// kinds of every range that covers it.
func sweepRanges(r []MetaRange) []MetaRange {
	type event struct {
		pos   int64
		kinds MetaKinds
		delta int
	}
	ev := make([]event, 0, 2*len(r))
	for _, x := range r {
		ev = append(ev, event{x.Start, x.Kinds, 1}, event{x.End, x.Kinds, -1})
	}
	sort.Slice(ev, func(i, j int) bool { return ev[i].pos < ev[j].pos })
	var out []MetaRange
	var count [16]int
	var cur MetaKinds // the kinds of [from, the next event)
	var from int64
	for i := 0; i < len(ev); {
		pos := ev[i].pos
		if cur != 0 && pos > from {
			if n := len(out); n > 0 && out[n-1].End == from && out[n-1].Kinds == cur {
				out[n-1].End = pos
			} else {
				out = append(out, MetaRange{from, pos, cur})
			}
		}
		for ; i < len(ev) && ev[i].pos == pos; i++ {
			for k := range count {
				if ev[i].kinds&(1<<k) != 0 {
					count[k] += ev[i].delta
				}
			}
		}
		cur = 0
		for k, c := range count {
			if c > 0 {
				cur |= 1 << k
			}
		}
		from = pos
	}
	return out
}

// Metadata returns the image file's metadata map. An error means some
// table could not be read (or the map does not fit in the memory budget);
// only images opened with LenientTables open without a map.
func (img *Image) Metadata() (*MetadataMap, error) {
	return img.top.metadata()
}

func (l *layer) metadata() (*MetadataMap, error) {
	l.metaOnce.Do(func() {
		m, err := l.buildMetadata()
		l.metaMap.Store(m)
		l.metaErr = err
	})
	return l.metaMap.Load(), l.metaErr
}

// maxMapTableBytes bounds the snapshot L1 tables that building one map
// reads (each distinct table once), and separately its bitmap tables:
// 256 MiB, eight L1 tables of the largest size qemu allows, or 16,384
// snapshots of a 1 TiB disk at 64 KiB clusters. An image beyond it is
// refused.
const maxMapTableBytes = 8 * maxL1Bytes

func (l *layer) buildMetadata() (*MetadataMap, error) {
	h := l.hdr
	cs := l.clusterSize()
	b := metaBuilder{charge: l.budget, clusterBits: l.clusterBits}
	b.add(0, cs, MetaHeader)
	if h.CryptMethod == cryptLUKS {
		b.add(int64(h.CryptoHeaderOffset), int64(h.CryptoHeaderLength), MetaCryptoHeader)
	}

	addL1 := func(l1 []uint64, kind, l2kind MetaKind, off int64) {
		b.add(off, int64(len(l1))*8, kind)
		for _, e := range l1 {
			if o := l1Entry(e).l2Offset(); o != 0 {
				b.add(o, cs, l2kind)
			}
		}
	}
	// The active L1 table as the header says (a snapshot image's l.l1
	// is the snapshot's, so read the header's own unless it is that).
	if t := l.l1.Load(); t != nil && t.off == int64(h.L1TableOffset) && t.len() == int64(h.L1Size) {
		addL1(t.entries, MetaL1, MetaL2, t.off)
	} else {
		active, err := l.readTransient(int64(h.L1TableOffset), int64(h.L1Size), "L1 table")
		if err != nil {
			return nil, err
		}
		addL1(active, MetaL1, MetaL2, int64(h.L1TableOffset))
		l.budget.sub(int64(len(active)) * 8)
	}

	if h.RefcountTableClusters > 0 {
		rt, err := l.refcountTable()
		if err != nil {
			return nil, err
		}
		b.add(int64(h.RefcountTableOffset), int64(h.RefcountTableClusters)*cs, MetaRefcountTable)
		for _, e := range rt {
			if o := int64(e & reftOffsetMask); o != 0 {
				b.add(o, cs, MetaRefcountBlock)
			}
		}
	}

	if len(l.snapshots) > 0 {
		b.add(int64(h.SnapshotsOffset), l.snapTableSize, MetaSnapshotTable)
		seen := map[uint64]bool{}
		var read int64
		for i := range l.snapshots {
			s := &l.snapshots[i]
			if !s.loadable() || s.L1Size == 0 || seen[s.L1TableOffset] {
				continue
			}
			seen[s.L1TableOffset] = true
			if read += int64(s.L1Size) * 8; read > maxMapTableBytes {
				return nil, &FormatError{File: l.name, Field: "snapshot table", Value: uint64(read), Offset: s.entryOff,
					Msg: fmt.Sprintf("the snapshots' L1 tables hold more than %d bytes", maxMapTableBytes)}
			}
			sl1, err := l.readTransient(int64(s.L1TableOffset), int64(s.L1Size), "snapshot L1 table")
			if err != nil {
				return nil, err
			}
			addL1(sl1, MetaSnapshotL1, MetaSnapshotL2, int64(s.L1TableOffset))
			l.budget.sub(int64(len(sl1)) * 8)
			if b.err != nil {
				break
			}
		}
	}

	addBitmap := func(start, length int64, k MetaKind, _ int64) { b.add(start, length, k) }
	if err := l.addBitmaps(addBitmap, true); err != nil {
		return nil, err
	}
	if b.err != nil {
		return nil, b.err
	}
	return b.build(), nil
}

// readTransient reads n words at off, charged to the layer's budget; the
// caller gives the charge back (8*n bytes) when done with them.
func (l *layer) readTransient(off, n int64, what string) ([]uint64, error) {
	if err := l.budget.add(n*8, what); err != nil {
		return nil, err
	}
	w, err := l.meta.words(off, n, what)
	if err != nil {
		l.budget.sub(n * 8)
	}
	return w, err
}

// checkNotMetadata fails when host range [off, off+n) of the image file,
// used as guest data by the L2 entry at entryOff, overlaps metadata.
func (l *layer) checkNotMetadata(off, n int64, e l2Entry, entryOff int64) error {
	if l.external() {
		return nil // data lives in another file
	}
	m, err := l.metadata()
	if err != nil {
		// Cannot tell (only lenient opens get this far without a
		// map): refuse rather than risk serving metadata.
		return fmt.Errorf("%s: guest data at host offset %#x cannot be checked against the metadata: %w", l.name, off, err)
	}
	if r, ok := m.Overlap(off, off+n); ok {
		what := "guest data"
		if e.compressed() {
			what = "compressed cluster"
		}
		return &FormatError{File: l.name, Field: "L2 entry", Value: e.word, Offset: entryOff,
			Msg: fmt.Sprintf("%s at host offset %#x overlaps the %s at %#x", what, off, r.Kinds, r.Start)}
	}
	return nil
}
