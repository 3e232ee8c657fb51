package ext4

import (
	"encoding/binary"
	"fmt"
)

// Block maps of ext2 and ext3 (blockmap.rst): i_block holds 12 direct
// block pointers, then one single, one double and one triple indirect
// pointer; an indirect block is an array of 32-bit block pointers. A zero
// pointer is a hole, at any level.
const directBlocks = 12

// indirectRun maps lblk through the block map: down to the table of
// pointers that holds its own pointer, then along that table while the
// blocks run on contiguously (or stay holes).
func (fs *FS) indirectRun(in *inode, lblk uint64) (run, error) {
	le := binary.LittleEndian
	apb := uint64(fs.sb.BlockSize / 4) // pointers a block
	var (
		levels int    // indirect blocks between i_block and the table
		root   uint32 // the pointer in i_block to walk from
		rel    = lblk // lblk relative to the subtree
	)
	switch {
	case rel < directBlocks:
		return fs.pointerRun(in, in.block[:4*directBlocks], lblk, rel)
	case rel-directBlocks < apb:
		rel -= directBlocks
		levels, root = 1, le.Uint32(in.block[4*12:])
	case rel-directBlocks-apb < apb*apb:
		rel -= directBlocks + apb
		levels, root = 2, le.Uint32(in.block[4*13:])
	case rel-directBlocks-apb-apb*apb < apb*apb*apb:
		rel -= directBlocks + apb + apb*apb
		levels, root = 3, le.Uint32(in.block[4*14:])
	default:
		return run{lblk: lblk, n: 1 << 62}, nil
	}
	ptr := uint64(root)
	for level := levels; level > 0; level-- {
		span := uint64(1) // the blocks one pointer of this level's table covers
		for range level - 1 {
			span *= apb
		}
		if ptr == 0 {
			// The whole subtree is a hole: from lblk to its end.
			subtree := span * apb
			return run{lblk: lblk, n: subtree - rel%subtree}, nil
		}
		if err := fs.checkBlocks(in, fmt.Sprintf("indirect block (level %d)", levels-level+1), ptr, 1); err != nil {
			return run{}, err
		}
		table, err := fs.dev.block(ptr)
		if err != nil {
			return run{}, fmt.Errorf("%s: inode %d: indirect block: %w", fs.typ, in.ino, err)
		}
		if level == 1 {
			return fs.pointerRun(in, table, lblk, rel%apb)
		}
		ptr = uint64(le.Uint32(table[4*(rel/span%apb):]))
	}
	panic("unreachable")
}

// pointerRun returns the run that starts at table[i] (the pointer of
// lblk): the pointers after it that continue its block, or its hole.
func (fs *FS) pointerRun(in *inode, table []byte, lblk, i uint64) (run, error) {
	le := binary.LittleEndian
	n := uint64(len(table) / 4)
	first := uint64(le.Uint32(table[4*i:]))
	j := i + 1
	if first == 0 {
		for j < n && le.Uint32(table[4*j:]) == 0 {
			j++
		}
		return run{lblk: lblk, n: j - i}, nil
	}
	for j < n && uint64(le.Uint32(table[4*j:])) == first+(j-i) {
		j++
	}
	if err := fs.checkBlocks(in, "block pointer", first, j-i); err != nil {
		return run{}, err
	}
	return run{lblk: lblk, n: j - i, pblk: first}, nil
}
