package qcow2

import (
	"fmt"
	"sync"
)

// Refcounts (specification, "Host cluster management").
//
// Reading an image needs no refcounts. They are read for two things: to
// tell, as qemu does, whether an image was made with
// preallocation=metadata (its block status then asks the host file which
// allocated clusters were never written), and for image checks.
//
// The refcount table (refcount_table_offset, refcount_table_clusters)
// holds 64-bit refcount block offsets (bits 9-63); a refcount block is one
// cluster of 2^refcount_order-bit entries, one per host cluster. Entries
// narrower than a byte are packed starting at the least significant bit,
// wider ones are big-endian.

const (
	reftOffsetMask = 0xfffffffffffffe00
	// maxRefcountTableBytes is qemu's QCOW_MAX_REFTABLE_SIZE.
	maxRefcountTableBytes = 8 << 20
)

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

// refcounts reads one layer's refcount structures; blocks go through the
// layer's table cache. The table is read on first use.
type refcounts struct {
	once  sync.Once
	table []uint64
	err   error
}

func (l *layer) refcountTable() ([]uint64, error) {
	r := &l.refs
	r.once.Do(func() {
		h := l.hdr
		n := int64(h.RefcountTableClusters) * l.clusterSize() / 8
		if r.err = l.budget.add(n*8, "refcount table"); r.err != nil {
			return
		}
		r.table, r.err = l.meta.words(int64(h.RefcountTableOffset), n, "refcount table")
	})
	return r.table, r.err
}

// refcount returns the reference count of host cluster c (c = host offset
// >> cluster_bits). Clusters beyond the refcount table, or in a range whose
// refcount block is not allocated, have refcount 0.
func (l *layer) refcount(c int64) (uint64, error) {
	width := int64(1) << l.hdr.RefcountOrder // bits per entry
	perBlock := l.clusterSize() * 8 / width
	words, _, err := l.refcountBlock(c / perBlock)
	if words == nil || err != nil {
		return 0, err
	}
	return blockRefcount(words, c%perBlock, width), nil
}

// refcountBlock returns refcount block ti of the refcount table and its
// offset; nil (and no error) if the table has no block there.
func (l *layer) refcountBlock(ti int64) (*table, int64, error) {
	table, err := l.refcountTable()
	if err != nil {
		return nil, 0, err
	}
	if ti >= int64(len(table)) {
		return nil, 0, nil
	}
	entryOff := int64(l.hdr.RefcountTableOffset) + 8*ti
	off := int64(table[ti] & reftOffsetMask)
	if off == 0 {
		return nil, 0, nil
	}
	if off&(l.clusterSize()-1) != 0 || off > l.fsize()-l.clusterSize() {
		return nil, 0, &FormatError{File: l.name, Field: "refcount table entry", Value: table[ti], Offset: entryOff,
			Msg: fmt.Sprintf("refcount block offset %#x is unaligned or past the end of the file", off)}
	}
	words, err := l.cache.get(cacheKey{owner: l.owner, off: off}, func() ([]uint64, error) {
		return l.meta.table(off, "refcount block")
	})
	return words, off, err
}

// blockRefcount returns entry i of a refcount block of width-bit entries.
func blockRefcount(words *table, i, width int64) uint64 {
	bit := i * width // position of the entry in the block, in bits
	w := words.word(bit / 64)
	mask := uint64(1)<<width - 1
	if width == 64 {
		mask = ^uint64(0)
	}
	if width >= 8 {
		return (w >> (64 - bit%64 - width)) & mask
	}
	byteInWord := (bit / 8) % 8
	return (w >> (56 - 8*byteInWord + bit%8)) & mask
}

// metadataPreallocated tells, like qemu's
// qcow2_detect_metadata_preallocation, whether the image looks made with
// preallocation=metadata (prealloc.go). qemu's block status then asks the
// host file whether allocated clusters hold data; so does Extent.
func (l *layer) metadataPreallocated() bool {
	l.preallocOnce.Do(func() { l.prealloc = l.detectPrealloc() })
	return l.prealloc
}
