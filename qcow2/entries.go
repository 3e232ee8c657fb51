package qcow2

// L1 and L2 entries (specification, "Cluster mapping"): the on-disk words
// that map guest clusters to host clusters, and the rules that classify
// them. Every rule about what an entry means is written here once; the
// lookup (mapping.go), the block status, the check and the writer all ask
// these methods.

const (
	l1OffsetMask    = 0x00fffffffffffe00 // bits 9-55: L2 table offset
	l2OffsetMask    = 0x00fffffffffffe00 // bits 9-55: host cluster offset
	l1Reserved      = 0x7f000000000001ff // must be zero in an L1 entry
	l2StdReserved   = 0x3f000000000001fe // must be zero in a standard L2 entry
	oflagCopied     = 1 << 63
	oflagCompressed = 1 << 62
	oflagZero       = 1 << 0 // standard entries only: "reads as zeros"

	subclustersPerCluster = 32
	subclusterAllocMask   = 0x00000000ffffffff // bitmap bits 0-31
)

// l1Entry is one entry of an L1 table.
type l1Entry uint64

// l2Offset is the host offset of the L2 table; 0 if none is allocated.
func (e l1Entry) l2Offset() int64 { return int64(e & l1OffsetMask) }

// copied is the COPIED flag: the L2 table's refcount is exactly 1, so it
// may be written in place.
func (e l1Entry) copied() bool { return e&oflagCopied != 0 }

// reserved returns the entry's reserved bits, which must be zero.
func (e l1Entry) reserved() uint64 { return uint64(e) & l1Reserved }

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

// compressed reports whether the entry describes a compressed cluster.
func (e l2Entry) compressed() bool { return e.word&oflagCompressed != 0 }

// copied is the COPIED flag: the data cluster's refcount is exactly 1.
func (e l2Entry) copied() bool { return e.word&oflagCopied != 0 }

// hostOffset is the host cluster offset of a standard (uncompressed) entry.
func (e l2Entry) hostOffset() int64 { return int64(e.word & l2OffsetMask) }

// allocated reports whether a standard entry has a host cluster. With an
// external data file, host offset 0 is a valid cluster: qemu tells it from
// "unallocated" by the COPIED flag, which every data file cluster carries
// (its refcount is always 1).
func (e l2Entry) allocated(external bool) bool {
	return e.word&l2OffsetMask != 0 || (external && e.copied())
}

// compressedRange decodes the host byte range of a compressed entry in an
// image of 2^clusterBits byte clusters: with x = 62 - (cluster_bits - 8),
// bits 0..x-1 are the byte offset, bits x..61 the number of additional
// 512-byte sectors. The data ends somewhere in its last sector.
func (e l2Entry) compressedRange(clusterBits uint) (off, size int64) {
	x := 62 - (clusterBits - 8)
	off = int64(e.word & (1<<x - 1))
	sectors := int64((e.word>>x)&(1<<(clusterBits-8)-1)) + 1
	return off, sectors*512 - off&511
}

// subclusterKind classifies subcluster sc of the entry, following qemu's
// qcow2_get_subcluster_type. For standard entries (extended false) the
// cluster is one subcluster and sc is 0. external tells whether the image
// has an external data file. It returns ok=false for an entry that is
// corrupt in itself (both "allocated" and "zero" set for a subcluster,
// allocated subclusters without a host cluster).
func (e l2Entry) subclusterKind(sc int, extended, external bool) (k kind, ok bool) {
	if e.compressed() {
		return kindCompressed, true
	}
	allocated := e.allocated(external)
	if !extended {
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
