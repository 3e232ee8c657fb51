package qcow2

// L1 and L2 entries (specification, "Cluster mapping").
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
