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
// It is built on first use from what the image already says: the header
// cluster, the L1 table and the L2 tables its entries name, the refcount
// table and blocks, the snapshot table with every snapshot's L1 table and
// L2 tables, and the bitmap directory, tables and data clusters. Building
// reads the refcount table, the snapshot L1 tables and the bitmap tables,
// never an L2 table. Memory is 24 bytes per range after merging adjacent
// ranges of one kind; ranges are clusters of the image file, so there are
// never more than its clusters.

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

// metaBuilder collects ranges, then sorts and merges them.
type metaBuilder struct{ ranges []MetaRange }

func (b *metaBuilder) add(start, length int64, k MetaKind) {
	if length > 0 {
		b.ranges = append(b.ranges, MetaRange{start, start + length, k})
	}
}

// build sorts the ranges and merges touching or overlapping ones of the
// same kind. Overlapping ranges of different kinds are kept apart: the
// first in sort order wins the overlap query.
func (b *metaBuilder) build() *MetadataMap {
	r := b.ranges
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
	return &MetadataMap{ranges: out}
}

// Metadata returns the image file's metadata map, building it on first
// use. An error means some table could not be read; the map is then nil.
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

func (l *layer) buildMetadata() (*MetadataMap, error) {
	h := l.hdr
	cs := l.clusterSize()
	var b metaBuilder
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
	// is the snapshot's, so read the header's own).
	active, err := l.meta.words(int64(h.L1TableOffset), int64(h.L1Size), "L1 table")
	if err != nil {
		return nil, err
	}
	addL1(active, MetaL1, MetaL2, int64(h.L1TableOffset))

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
		seen := map[int64]bool{}
		for _, s := range l.snapshots {
			if seen[int64(s.L1TableOffset)] {
				continue
			}
			seen[int64(s.L1TableOffset)] = true
			sl1, err := l.meta.words(int64(s.L1TableOffset), int64(s.L1Size), "snapshot L1 table")
			if err != nil {
				return nil, err
			}
			addL1(sl1, MetaSnapshotL1, MetaSnapshotL2, int64(s.L1TableOffset))
		}
	}

	if err := l.addBitmaps(&b); err != nil {
		return nil, err
	}
	return b.build(), nil
}

// checkNotMetadata fails when host range [off, off+n) of the image file,
// used as guest data by the L2 entry at entryOff, overlaps metadata.
func (l *layer) checkNotMetadata(off, n int64, e l2Entry, entryOff int64) error {
	if l.external() {
		return nil // data lives in another file
	}
	m, err := l.metadata()
	if err != nil || m == nil {
		return nil // cannot tell; the read itself will still be checked against EOF
	}
	if r, ok := m.Overlap(off, off+n); ok {
		return &FormatError{File: l.name, Field: "L2 entry", Value: e.word, Offset: entryOff,
			Msg: fmt.Sprintf("guest data at host offset %#x overlaps the %s at %#x", off, r.Kind, r.Start)}
	}
	return nil
}
