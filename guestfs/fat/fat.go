package fat

import (
	"encoding/binary"
	"fmt"

	"github.com/qcowfs/qcowfs/guestfs"
)

// The FAT, read on demand: blocks of fatBlock bytes of the first FAT (the
// one Linux reads; it writes every copy alike), kept in a cache bounded by
// fatCacheBytes. A FAT16 is at most 128 KiB and stays whole in it; a large
// FAT32's (4 bytes a cluster, up to 1 GiB) is never copied whole.
const (
	fatBlock      = 16 << 10
	fatCacheBytes = 4 << 20
)

// endOfChain is what fatTable.next returns for the last cluster of a
// chain: an end-of-chain mark or, as Linux reads it, a bad-cluster mark.
const endOfChain = ^uint32(0)

type fatTable struct {
	g      *geometry
	read   func(p []byte, off int64) error
	blocks *lru[int64, []byte]
}

func newFATTable(g *geometry, read func(p []byte, off int64) error) *fatTable {
	return &fatTable{g: g, read: read, blocks: newLRU[int64, []byte](fatCacheBytes)}
}

// block returns FAT block i, shorter than fatBlock at the FAT's end.
func (t *fatTable) block(i int64) ([]byte, error) {
	if b, ok := t.blocks.get(i); ok {
		return b, nil
	}
	n := min(int64(fatBlock), t.g.fatLen-i*fatBlock)
	b := make([]byte, n)
	if err := t.read(b, t.g.fatStart+i*fatBlock); err != nil {
		return nil, err
	}
	t.blocks.put(i, b, len(b))
	return b, nil
}

// bytes returns the n bytes (2 or 4) of the FAT at off, which may span two
// blocks (a FAT12 entry does).
func (t *fatTable) bytes(off int64, n int) ([4]byte, error) {
	var out [4]byte
	for k := 0; k < n; {
		o := off + int64(k)
		b, err := t.block(o / fatBlock)
		if err != nil {
			return out, err
		}
		i := int(o % fatBlock)
		if i >= len(b) {
			return out, &guestfs.FormatError{FS: fsType, Field: "FAT byte offset", Value: uint64(o), Msg: fmt.Sprintf("past the end of the FAT (%d bytes)", t.g.fatLen)}
		}
		k += copy(out[k:n], b[i:])
	}
	return out, nil
}

func fatErr(c uint32, format string, args ...any) error {
	return &guestfs.FormatError{FS: fsType, Field: "FAT entry of cluster", Value: uint64(c), Msg: fmt.Sprintf(format, args...)}
}

// next returns the cluster after c in its chain (c is a cluster, checked
// by the caller), or endOfChain. A free entry inside a chain, or one that
// points outside [2, maxCluster), is corrupt, as Linux's fat_get_cluster
// and fat_ent_read find it.
func (t *fatTable) next(c uint32) (uint32, error) {
	var v, bad uint32
	switch t.g.bits {
	case 12:
		b, err := t.bytes(int64(c)+int64(c/2), 2)
		if err != nil {
			return 0, err
		}
		w := uint32(binary.LittleEndian.Uint16(b[:]))
		if c&1 != 0 {
			w >>= 4
		}
		v, bad = w&0xFFF, 0xFF7
	case 16:
		b, err := t.bytes(int64(c)*2, 2)
		if err != nil {
			return 0, err
		}
		v, bad = uint32(binary.LittleEndian.Uint16(b[:])), 0xFFF7
	default:
		b, err := t.bytes(int64(c)*4, 4)
		if err != nil {
			return 0, err
		}
		v, bad = binary.LittleEndian.Uint32(b[:])&0x0FFFFFFF, 0x0FFFFFF7
	}
	switch {
	case v >= bad:
		return endOfChain, nil
	case v == 0:
		return 0, fatErr(c, "free (0) inside a cluster chain")
	case v < firstCluster || v >= t.g.maxCluster:
		return 0, fatErr(c, "points to cluster %d, outside the data area (2 to %d)", v, t.g.maxCluster-1)
	}
	return v, nil
}
