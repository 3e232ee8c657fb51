package qcow2

import (
	"encoding/binary"
	"fmt"
)

// L1 and L2 entries (specification, "Cluster mapping"), and the lookup of
// guest offsets through them.
//
// Guest offsets map to host offsets through two levels: the L1 table, read
// once at open, points to L2 tables, which are loaded on demand through the
// Cache. An L2 entry describes one cluster; with extended L2 entries
// (incompatible bit 4) it also carries a bitmap describing each of the
// cluster's 32 subclusters.

const (
	l1OffsetMask    = 0x00fffffffffffe00 // bits 9-55: L2 table offset
	l2OffsetMask    = 0x00fffffffffffe00 // bits 9-55: host cluster offset
	l1Reserved      = 0x7f000000000001ff // must be zero in an L1 entry
	oflagCopied     = 1 << 63
	oflagCompressed = 1 << 62
	oflagZero       = 1 << 0 // standard entries only: "reads as zeros"

	subclustersPerCluster = 32
	subclusterAllocMask   = 0x00000000ffffffff // bitmap bits 0-31
)

// kind is what one guest (sub)cluster is, as stored in one layer.
type kind uint8

const (
	// kindUnallocated: not allocated in this layer; read the backing
	// file, or zeros if there is none.
	kindUnallocated kind = iota
	// kindZero: reads as zeros, whatever the backing file holds. With a
	// host offset (qemu's ZERO_ALLOC, from preallocation or a zero write
	// without unmap) the host cluster must not be read.
	kindZero
	// kindNormal: the bytes are in the data file at the host offset.
	kindNormal
	// kindCompressed: the whole cluster is compressed; see compress.go.
	kindCompressed
)

func (k kind) String() string {
	switch k {
	case kindUnallocated:
		return "unallocated"
	case kindZero:
		return "zero"
	case kindNormal:
		return "data"
	case kindCompressed:
		return "compressed"
	}
	return "invalid"
}

// l2Entry is one decoded L2 entry: word 0 of the specification's entry, and
// for extended L2 entries word 1, the subcluster bitmap.
type l2Entry struct {
	word   uint64
	bitmap uint64
}

// hostOffset is the host cluster offset of a standard (uncompressed) entry.
func (e l2Entry) hostOffset() int64 { return int64(e.word & l2OffsetMask) }

// subclusterKind classifies subcluster sc of the entry, following qemu's
// qcow2_get_subcluster_type. For standard entries the cluster is one
// subcluster and sc is 0. It returns ok=false for an entry that is corrupt
// in itself (both "allocated" and "zero" set for a subcluster, allocated
// subclusters without a host cluster).
func (l *layer) subclusterKind(e l2Entry, sc int) (k kind, ok bool) {
	if e.word&oflagCompressed != 0 {
		return kindCompressed, true
	}
	off := e.word & l2OffsetMask
	// With an external data file, host offset 0 is a valid cluster: qemu
	// tells it from "unallocated" by the COPIED flag, which every data
	// file cluster carries (refcount is always 1).
	allocated := off != 0 || (l.dataFile != nil && e.word&oflagCopied != 0)
	if !l.extendedL2 {
		switch {
		case e.word&oflagZero != 0:
			return kindZero, true
		case allocated:
			return kindNormal, true
		default:
			return kindUnallocated, true
		}
	}
	// Extended L2: word 0's zero bit is reserved; the bitmap decides.
	alloc := e.bitmap & subclusterAllocMask
	zero := e.bitmap >> 32
	if allocated {
		if alloc&zero != 0 {
			return 0, false
		}
	} else if alloc != 0 {
		return 0, false
	}
	switch {
	case zero&(1<<sc) != 0:
		return kindZero, true
	case alloc&(1<<sc) != 0:
		return kindNormal, true
	default:
		return kindUnallocated, true
	}
}

// l2Table returns the L2 table with index l1Index, or nil if the L1 entry
// is unallocated. The table holds cluster_size/8 words: one per entry, or
// two per entry with extended L2 entries.
func (l *layer) l2Table(l1Index int64) ([]uint64, error) {
	if l1Index >= int64(len(l.l1)) {
		return nil, nil
	}
	e := l.l1[l1Index]
	entryOff := l.l1Offset + 8*l1Index
	off := int64(e & l1OffsetMask)
	if off == 0 {
		return nil, nil
	}
	if off&(l.clusterSize()-1) != 0 {
		return nil, &FormatError{File: l.name, Field: "L1 entry", Value: e, Offset: entryOff,
			Msg: fmt.Sprintf("L2 table offset %#x is not cluster aligned", off)}
	}
	if off > l.fileSize-l.clusterSize() {
		return nil, &FormatError{File: l.name, Field: "L1 entry", Value: e, Offset: entryOff,
			Msg: fmt.Sprintf("L2 table at %#x runs past the end of the file (%d bytes)", off, l.fileSize)}
	}
	return l.cache.get(cacheKey{owner: l.owner, off: off}, func() ([]uint64, error) {
		return l.readTable(off, "L2 table")
	})
}

// readTable reads the cluster at off of the image file as big-endian
// 64-bit words: an L2 table or a refcount block.
func (l *layer) readTable(off int64, what string) ([]uint64, error) {
	buf := make([]byte, l.clusterSize())
	if _, err := l.file.ReadAt(buf, off); err != nil {
		return nil, fmt.Errorf("%s: reading %s at byte offset %d: %w", l.name, what, off, err)
	}
	t := make([]uint64, len(buf)/8)
	for i := range t {
		t[i] = binary.BigEndian.Uint64(buf[i*8:])
	}
	return t, nil
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
	table, err := l.l2Table(off / l2Span)
	if err != nil {
		return run{}, err
	}
	if table == nil {
		return run{kind: kindUnallocated, length: n, host: -1}, nil
	}
	l1Index := off / l2Span
	l2Base := int64(l.l1[l1Index] & l1OffsetMask)

	words := int64(l.l2EntryWords())
	var r run
	end := off + n
	for pos := off; pos < end; {
		idx := (pos >> l.clusterBits) & (1<<l.l2Bits - 1)
		e := l2Entry{word: table[idx*words]}
		if l.extendedL2 {
			e.bitmap = table[idx*words+1]
		}
		entryOff := l2Base + idx*words*8
		sc := int((pos & (cs - 1)) >> l.scBits)
		k, ok := l.subclusterKind(e, sc)
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

// l2EntryWords is the size of one L2 entry in 64-bit words: 2 with
// extended L2 entries (the entry and its subcluster bitmap), else 1.
func (l *layer) l2EntryWords() int {
	if l.extendedL2 {
		return 2
	}
	return 1
}
