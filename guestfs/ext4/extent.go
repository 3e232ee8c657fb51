package ext4

import (
	"encoding/binary"
	"fmt"
)

// A run says what a file's logical blocks lblk to lblk+n-1 are: on disk
// from pblk on, or a hole (pblk 0; no data block is ever block 0, which
// holds the superblock or boot sector), or allocated but unwritten
// (reads as zeros, and is a hole to SEEK_HOLE, as on the kernel's mount).
type run struct {
	lblk, n   uint64
	pblk      uint64
	unwritten bool
}

func (r run) data() bool { return r.pblk != 0 && !r.unwritten }

// maxLogical is one past the largest logical block either mapping can
// name (extents: a 32-bit ee_block).
const maxLogical = 1 << 32

// mapBlock returns the run that holds logical block lblk of in, as long
// as it runs on: to the end of its extent, or of its contiguous block
// pointers, or of the hole.
func (fs *FS) mapBlock(in *inode, lblk uint64) (run, error) {
	if lblk >= maxLogical {
		return run{lblk: lblk, n: 1 << 62}, nil
	}
	if in.flags&flagExtents != 0 {
		return fs.extentRun(in, lblk)
	}
	return fs.indirectRun(in, lblk)
}

// The extent tree (ifork.rst): a 12-byte header, then 12-byte entries,
// index entries above depth 0 and extents at depth 0. The root is in
// i_block; other nodes fill a block and end with a CRC-32C tail.
const (
	extentMagic    = 0xF30A
	extentMaxDepth = 5 // EXT4_MAX_EXTENT_DEPTH
	extentInitMax  = 32768
)

type extentHeader struct {
	entries, max, depth uint16
}

// extentRun walks the tree from the root to the leaf that covers lblk.
// Every node is checked as the kernel checks it (ext4_ext_check,
// ext4_valid_extent_entries): magic, counts, a depth one less than its
// parent's (so no walk can cycle), the checksum, entries in increasing
// order, extents inside the file system and before the next entry.
func (fs *FS) extentRun(in *inode, lblk uint64) (run, error) {
	le := binary.LittleEndian
	node := in.block[:]
	end := uint64(maxLogical) // the end of what this node covers
	depth := -1
	for level := 0; ; level++ {
		h, err := fs.extentHeader(in, node, level, depth)
		if err != nil {
			return run{}, err
		}
		depth = int(h.depth)
		ents := node[12 : 12+12*int(h.entries)]
		// The last entry that starts at or before lblk, and the start of
		// the one after it.
		i := -1
		for j := 0; j < int(h.entries); j++ {
			first := uint64(le.Uint32(ents[12*j:]))
			if j > 0 && first <= uint64(le.Uint32(ents[12*(j-1):])) {
				return run{}, fs.formatError(in.ino, "extent ee_block", first, "not after the entry before it (depth %d)", depth)
			}
			if first <= lblk {
				i = j
			}
		}
		next := end
		if i+1 < int(h.entries) {
			next = uint64(le.Uint32(ents[12*(i+1):]))
		}
		if depth == 0 {
			if i >= 0 {
				e := ents[12*i:]
				first := uint64(le.Uint32(e))
				n := uint64(le.Uint16(e[4:]))
				unwritten := n > extentInitMax
				if unwritten {
					n -= extentInitMax
				}
				pblk := uint64(le.Uint16(e[6:]))<<32 | uint64(le.Uint32(e[8:]))
				if n == 0 || first+n > next {
					return run{}, fs.formatError(in.ino, "extent ee_len", n, "zero, or past the next extent's start %d (ee_block %d)", next, first)
				}
				if err := fs.checkBlocks(in, "extent ee_start", pblk, n); err != nil {
					return run{}, err
				}
				if lblk < first+n {
					return run{lblk: lblk, n: first + n - lblk, pblk: pblk + lblk - first, unwritten: unwritten}, nil
				}
			}
			return run{lblk: lblk, n: next - lblk}, nil
		}
		if i < 0 {
			// Before the first index entry: nothing maps there.
			return run{lblk: lblk, n: next - lblk}, nil
		}
		e := ents[12*i:]
		child := uint64(le.Uint16(e[8:]))<<32 | uint64(le.Uint32(e[4:]))
		if err := fs.checkBlocks(in, "extent index ei_leaf", child, 1); err != nil {
			return run{}, err
		}
		if node, err = fs.dev.block(child); err != nil {
			return run{}, fmt.Errorf("%s: inode %d: extent block: %w", fs.typ, in.ino, err)
		}
		if err := fs.extentTail(in, node, child); err != nil {
			return run{}, err
		}
		end = next
	}
}

// extentHeader checks the header of a node at level (0: the root in
// i_block) whose parent has depth parentDepth.
func (fs *FS) extentHeader(in *inode, node []byte, level, parentDepth int) (extentHeader, error) {
	le := binary.LittleEndian
	bad := func(field string, v uint64, format string, args ...any) error {
		return fs.formatError(in.ino, "extent header "+field, v, format+fmt.Sprintf(" (tree level %d)", level), args...)
	}
	if m := le.Uint16(node); m != extentMagic {
		return extentHeader{}, bad("eh_magic", uint64(m), "not 0x%X", extentMagic)
	}
	h := extentHeader{entries: le.Uint16(node[2:]), max: le.Uint16(node[4:]), depth: le.Uint16(node[6:])}
	if limit := (len(node) - 12) / 12; int(h.max) > limit || h.max == 0 {
		return h, bad("eh_max", uint64(h.max), "not from 1 to %d", limit)
	}
	if h.entries > h.max {
		return h, bad("eh_entries", uint64(h.entries), "more than eh_max %d", h.max)
	}
	if level == 0 && h.depth > extentMaxDepth {
		return h, bad("eh_depth", uint64(h.depth), "deeper than %d", extentMaxDepth)
	}
	if level > 0 && int(h.depth) != parentDepth-1 {
		return h, bad("eh_depth", uint64(h.depth), "not one less than its parent's %d", parentDepth)
	}
	if h.entries == 0 && h.depth > 0 {
		return h, bad("eh_entries", 0, "an index node with no entries")
	}
	return h, nil
}

// extentTail checks an extent block's checksum (struct ext4_extent_tail,
// right after eh_max entries) with metadata_csum.
func (fs *FS) extentTail(in *inode, node []byte, pblk uint64) error {
	if !fs.sb.metadataCsum() {
		return nil
	}
	max := int(binary.LittleEndian.Uint16(node[4:]))
	off := 12 + 12*max
	if max == 0 || off+4 > len(node) {
		return nil // extentHeader refuses it
	}
	stored := binary.LittleEndian.Uint32(node[off:])
	if c := crc32c(in.csumSeed, node[:off]); c != stored {
		return fs.formatError(in.ino, "extent block checksum", uint64(stored), "does not match block %d's (0x%x)", pblk, c)
	}
	return nil
}

// checkBlocks refuses blocks pblk to pblk+n-1 unless they lie in the file
// system past the first data block (ext4_inode_block_valid).
func (fs *FS) checkBlocks(in *inode, field string, pblk, n uint64) error {
	if pblk <= uint64(fs.sb.FirstDataBlock) || pblk >= fs.sb.BlocksCount || n > fs.sb.BlocksCount-pblk {
		return fs.formatError(in.ino, field, pblk, "%d blocks there are not inside the file system (blocks %d to %d)", n, fs.sb.FirstDataBlock+1, fs.sb.BlocksCount-1)
	}
	return nil
}
