package ext4

import (
	"encoding/binary"
	"fmt"
)

// Group descriptors (group_descr.rst): 32 bytes, or s_desc_size (64 or
// more) with the 64bit feature. Only the inode table's location is read;
// bitmaps and counts matter to a writer, not here.
const (
	gdInodeTableLo = 0x08
	gdChecksum     = 0x1E
	gdInodeTableHi = 0x28
)

// inodeTable returns the first block of block group g's inode table. The
// descriptor is read when first needed (not all at Open: a file system
// may have a million groups) and checked then, as the kernel checks each
// at mount (ext4_check_descriptors): its checksum and an inode table that
// lies inside the file system.
func (fs *FS) inodeTable(g uint32) (uint64, error) {
	sb := fs.sb
	n := g / sb.descPerBlock
	blk, err := fs.dev.block(sb.descBlock(n))
	if err != nil {
		return 0, fmt.Errorf("%s: group %d descriptor: %w", fs.typ, g, err)
	}
	d := blk[(g%sb.descPerBlock)*uint32(sb.DescSize):][:sb.DescSize]
	le := binary.LittleEndian
	bad := func(field string, v uint64, format string, args ...any) error {
		return fs.formatError(0, fmt.Sprintf("group %d %s", g, field), v, format, args...)
	}
	if want, ok := fs.descChecksum(g, d); ok && want != le.Uint16(d[gdChecksum:]) {
		return 0, bad("bg_checksum", uint64(le.Uint16(d[gdChecksum:])), "does not match the descriptor's (0x%04x)", want)
	}
	table := uint64(le.Uint32(d[gdInodeTableLo:]))
	if sb.DescSize >= 64 {
		table |= uint64(le.Uint32(d[gdInodeTableHi:])) << 32
	}
	tableBlocks := uint64(sb.InodesPerGroup) * uint64(sb.InodeSize) / uint64(sb.BlockSize)
	if table <= uint64(sb.FirstDataBlock) || table >= sb.BlocksCount || tableBlocks > sb.BlocksCount-table {
		return 0, bad("bg_inode_table", table, "an inode table of %d blocks there does not fit in the file system (%d blocks)", tableBlocks, sb.BlocksCount)
	}
	return table, nil
}

// descChecksum computes group descriptor d's checksum
// (ext4_group_desc_csum): the low 16 bits of CRC-32C with metadata_csum,
// CRC-16 with gdt_csum; ok is false when the file system keeps neither.
func (fs *FS) descChecksum(g uint32, d []byte) (uint16, bool) {
	sb := fs.sb
	var gle [4]byte
	binary.LittleEndian.PutUint32(gle[:], g)
	switch {
	case sb.metadataCsum():
		c := crc32c(sb.csumSeed, gle[:])
		c = crc32c(c, d[:gdChecksum])
		c = crc32c(c, []byte{0, 0})
		c = crc32c(c, d[gdChecksum+2:])
		return uint16(c), true
	case sb.FeatureROCompat&roCompatGdtCsum != 0:
		c := crc16(0xFFFF, sb.UUID[:])
		c = crc16(c, gle[:])
		c = crc16(c, d[:gdChecksum])
		if len(d) > 32 {
			c = crc16(c, d[32:])
		}
		return c, true
	}
	return 0, false
}
