package qcow2

import (
	"fmt"
	"sync/atomic"
)

// The read side of the cluster mapping (imago's get_mapping): what one
// layer stores at a guest offset, through its L1 table, held in memory, and
// its L2 tables, loaded on demand through the Cache. The write side, which
// makes sure a writable host cluster backs a guest range, will live with
// the writer.

// l1Table is a layer's L1 table in memory: where it lies in the image file
// and its entries. Entries are loaded atomically, so that a writer may
// change them in place while requests read them; the table is replaced as a
// whole (a resize) by storing a new *l1Table.
type l1Table struct {
	off     int64 // host offset of the table in the image file
	entries []uint64
}

func (t *l1Table) entry(i int64) l1Entry { return l1Entry(atomic.LoadUint64(&t.entries[i])) }

func (t *l1Table) len() int64 { return int64(len(t.entries)) }

// l2Table returns the L2 table with index l1Index and the host offset it
// was loaded from, or nil if the L1 entry is unallocated. The table holds
// cluster_size/8 words: one per entry, or two per entry with extended L2
// entries.
func (l *layer) l2Table(l1Index int64) (*table, int64, error) {
	t := l.l1.Load()
	if l1Index >= t.len() {
		return nil, 0, nil
	}
	off := t.entry(l1Index).l2Offset()
	if off == 0 {
		return nil, 0, nil
	}
	if err := l.checkL1Entry(t, l1Index); err != nil {
		return nil, 0, err
	}
	tab, err := l.cache.get(cacheKey{owner: l.owner, off: off}, func() ([]uint64, error) {
		return l.meta.table(off, "L2 table")
	})
	return tab, off, err
}

// run is a stretch of guest bytes that one layer stores the same way.
type run struct {
	kind   kind
	length int64
	// host is the host offset of the run's first byte in the data file,
	// for kindNormal and for preallocated zero clusters; -1 otherwise.
	host int64
	// entry is the L2 entry of a kindCompressed run (one cluster at most).
	entry l2Entry
	// entryOff is the byte offset of that entry in the image file.
	entryOff int64
}

// lookup returns the run of this qcow2 layer that starts at guest offset
// off, at most n bytes long (n > 0). It reads at most one L2 table: a run
// never crosses an L2 table boundary.
func (l *layer) lookup(off, n int64) (run, error) {
	cs := l.clusterSize()
	scSize := int64(1) << l.scBits
	l2Span := cs << l.l2Bits // guest bytes mapped by one L2 table
	if rest := l2Span - off&(l2Span-1); n > rest {
		n = rest
	}
	l1Index := off / l2Span
	table, l2Base, err := l.l2Table(l1Index)
	if err != nil {
		return run{}, err
	}
	if table == nil {
		return run{kind: kindUnallocated, length: n, host: -1}, nil
	}

	words := int64(l.l2EntryWords())
	var r run
	end := off + n
	for pos := off; pos < end; {
		idx := (pos >> l.clusterBits) & (1<<l.l2Bits - 1)
		e := table.entry(idx, l.extendedL2)
		entryOff := l2Base + idx*words*8
		sc := int((pos & (cs - 1)) >> l.scBits)
		k, ok := e.subclusterKind(sc, l.extendedL2, l.external())
		if !ok {
			return run{}, &FormatError{File: l.name, Field: "L2 entry", Value: e.word, Offset: entryOff,
				Msg: fmt.Sprintf("invalid subcluster bitmap %#x", e.bitmap)}
		}
		host := int64(-1)
		// The host offset of the subcluster, where the cluster has one:
		// data, preallocated zeros, and (extended L2) unallocated
		// subclusters of an allocated cluster, which qemu's block
		// status reports with their offset too.
		if k != kindCompressed {
			if h := e.hostOffset(); h != 0 || k == kindNormal {
				if h&(cs-1) != 0 {
					return run{}, &FormatError{File: l.name, Field: "L2 entry", Value: e.word, Offset: entryOff,
						Msg: fmt.Sprintf("host cluster offset %#x is not cluster aligned", h)}
				}
				host = h + pos&(cs-1)
			}
		}
		if k == kindNormal && host >= l.dataSize() {
			return run{}, &FormatError{File: l.name, Field: "L2 entry", Value: e.word, Offset: entryOff,
				Msg: fmt.Sprintf("host cluster offset %#x is past the end of the data file (%d bytes)", e.hostOffset(), l.dataSize())}
		}
		// The stretch of this subcluster from pos.
		step := scSize - pos&(scSize-1)
		if step > end-pos {
			step = end - pos
		}
		if pos == off {
			r = run{kind: k, length: step, host: host, entry: e, entryOff: entryOff}
			if k == kindCompressed {
				// A compressed run is one cluster at most.
				r.length = min(cs-pos&(cs-1), n)
				return r, nil
			}
		} else {
			contiguous := k == r.kind && (host < 0) == (r.host < 0) &&
				(host < 0 || host == r.host+r.length)
			if !contiguous {
				break
			}
			r.length += step
		}
		pos += step
	}
	if r.kind == kindNormal {
		// Guest data must not come from the image's own metadata.
		if err := l.checkNotMetadata(r.host, r.length, r.entry, r.entryOff); err != nil {
			return run{}, err
		}
	}
	return r, nil
}
