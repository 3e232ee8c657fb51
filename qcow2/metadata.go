package qcow2

import (
	"fmt"
	"sort"
)

// The metadata map: every host range of an image file that holds metadata,
// by kind, as a sorted list of disjoint ranges with an O(log n) overlap
// query. The read path asks it whether a data or compressed cluster points
// into metadata (corruption: the read fails instead of handing metadata to
// the guest), and the image check uses it to report such overlaps.
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
// of one kind: the builder merges as it goes, so tables that name the same
// clusters over and over cost no more than the distinct ranges.

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
)

var metaNames = [...]string{"", "header", "L1 table", "L2 table", "refcount table", "refcount block",
	"snapshot table", "snapshot L1 table", "snapshot L2 table", "bitmap directory", "bitmap table", "bitmap data"}

func (k MetaKind) String() string {
	if int(k) < len(metaNames) {
		return metaNames[k]
	}
	return "metadata"
}

// MetaRange is a host range [Start, End) holding metadata of one kind.
type MetaRange struct {
	Start, End int64
	Kind       MetaKind
}

// MetadataMap is the sorted, disjoint list of an image file's metadata.
// A map is never changed once published: the writer publishes a new one
// (with) when it allocates or frees metadata, and readers keep whatever map
// they loaded.
type MetadataMap struct {
	ranges []MetaRange
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

// conflict returns the first metadata range overlapping [start, end) whose
// kind is not one of allowed: a write of guest data (allowed: none), or of
// an L2 table (allowed: MetaL2), must not land there.
func (m *MetadataMap) conflict(start, end int64, allowed ...MetaKind) (MetaRange, bool) {
	r := m.ranges
	for i := sort.Search(len(r), func(i int) bool { return r[i].End > start }); i < len(r) && r[i].Start < end; i++ {
		ok := false
		for _, k := range allowed {
			ok = ok || r[i].Kind == k
		}
		if !ok {
			return r[i], true
		}
	}
	return MetaRange{}, false
}

// with returns a copy of the map with [start, end) set to kind (merged with
// touching ranges of the same kind); kind 0 removes the range instead. The
// copy costs O(n): metadata is allocated a cluster at a time, seldom
// compared with data (one L2 table per 512 MiB of guest disk at the
// default cluster size).
func (m *MetadataMap) with(start, end int64, kind MetaKind) *MetadataMap {
	r := m.ranges
	i := sort.Search(len(r), func(i int) bool { return r[i].End >= start })
	out := make([]MetaRange, 0, len(r)+2)
	out = append(out, r[:i]...)
	var tail []MetaRange
	j := i
	for ; j < len(r) && r[j].Start <= end; j++ {
		x := r[j]
		if kind != 0 && x.Kind == kind {
			start, end = min(start, x.Start), max(end, x.End)
			continue
		}
		// Another kind: keep what lies outside [start, end).
		if x.Start < start {
			out = append(out, MetaRange{x.Start, min(x.End, start), x.Kind})
		}
		if x.End > end {
			tail = append(tail, MetaRange{max(x.Start, end), x.End, x.Kind})
		}
	}
	if kind != 0 {
		out = append(out, MetaRange{start, end, kind})
	}
	out = append(out, tail...)
	out = append(out, r[j:]...)
	return &MetadataMap{ranges: out}
}

// metaBuilder collects ranges, then sorts and merges them. With a charge,
// the memory of its ranges is charged to it, and it merges what it has
// whenever its buffer is full, growing it only when merging frees less
// than half; the first charge that fails is kept in err and ends the
// collecting.
type metaBuilder struct {
	ranges []MetaRange
	charge *charge // nil: no budget (tests, the check's counting)
	held   int64   // bytes charged for ranges' buffer
	err    error
}

// metaRangeBytes is the memory of one MetaRange.
const metaRangeBytes = 24

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
	b.ranges = append(b.ranges, MetaRange{start, start + length, k})
}

// grow makes room for more ranges: by merging those it has, or by a
// larger buffer, charged first.
func (b *metaBuilder) grow() {
	if n := len(b.ranges); n >= 1024 {
		b.ranges = mergeRanges(b.ranges)
		if len(b.ranges) <= n/2 {
			return
		}
	}
	newCap := max(1024, 2*cap(b.ranges))
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

// build sorts the ranges and merges touching or overlapping ones of the
// same kind. Overlapping ranges of different kinds are kept apart: the
// first in sort order wins the overlap query.
func (b *metaBuilder) build() *MetadataMap {
	r := mergeRanges(b.ranges)
	if b.charge != nil && cap(r) > 2*len(r)+1024 {
		// Keep only what the map needs.
		exact := make([]MetaRange, len(r))
		copy(exact, r)
		r = exact
		b.charge.sub(b.held - int64(cap(r))*metaRangeBytes)
		b.held = int64(cap(r)) * metaRangeBytes
	}
	return &MetadataMap{ranges: r}
}

// mergeRanges sorts r and merges it in place (see build).
func mergeRanges(r []MetaRange) []MetaRange {
	sort.Slice(r, func(i, j int) bool {
		if r[i].Start != r[j].Start {
			return r[i].Start < r[j].Start
		}
		return r[i].Kind < r[j].Kind
	})
	out := r[:0]
	for _, x := range r {
		if n := len(out); n > 0 && out[n-1].Kind == x.Kind && x.Start <= out[n-1].End {
			out[n-1].End = max(out[n-1].End, x.End)
			continue
		}
		if n := len(out); n > 0 && x.Start < out[n-1].End {
			// Overlaps a range of another kind (a corrupt image):
			// keep what lies beyond it.
			if x.End <= out[n-1].End {
				continue
			}
			x.Start = out[n-1].End
		}
		out = append(out, x)
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
	b := metaBuilder{charge: l.budget}
	b.add(0, cs, MetaHeader)

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
			Msg: fmt.Sprintf("%s at host offset %#x overlaps the %s at %#x", what, off, r.Kind, r.Start)}
	}
	return nil
}
