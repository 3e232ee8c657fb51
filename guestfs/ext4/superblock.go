package ext4

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"strings"

	"github.com/qcowfs/qcowfs/guestfs"
)

// The superblock lives 1024 bytes into the file system, whatever the block
// size, and is 1024 bytes long (Documentation/filesystems/ext4/super.rst).
const (
	superblockOffset = 1024
	superblockSize   = 1024
	superMagic       = 0xEF53
)

// Feature flags (super.rst, "s_feature_compat" and the two after it).
const (
	compatHasJournal   = 0x4
	compatDirIndex     = 0x20
	compatSparseSuper2 = 0x200
	compatFastCommit   = 0x400

	incompatCompression = 0x1
	incompatFiletype    = 0x2
	incompatRecover     = 0x4
	incompatJournalDev  = 0x8
	incompatMetaBG      = 0x10
	incompatExtents     = 0x40
	incompat64Bit       = 0x80
	incompatMMP         = 0x100
	incompatFlexBG      = 0x200
	incompatEAInode     = 0x400
	incompatDirData     = 0x1000
	incompatCsumSeed    = 0x2000
	incompatLargeDir    = 0x4000
	incompatInlineData  = 0x8000
	incompatEncrypt     = 0x10000
	incompatCasefold    = 0x20000

	roCompatSparseSuper  = 0x1
	roCompatLargeFile    = 0x2
	roCompatBtreeDir     = 0x4
	roCompatHugeFile     = 0x8
	roCompatGdtCsum      = 0x10
	roCompatBigalloc     = 0x200
	roCompatMetadataCsum = 0x400
)

// incompatRead is every incompatible feature this package reads. The
// kernel refuses to mount a file system with any other; so does Open.
// Encrypted files and casefolded directories are features of single
// inodes: the file system opens, and such an inode is an error (encrypted)
// or looked up by exact name only (casefold).
const incompatRead = incompatFiletype | incompatRecover | incompatMetaBG | incompatExtents |
	incompat64Bit | incompatMMP | incompatFlexBG | incompatEAInode | incompatCsumSeed |
	incompatLargeDir | incompatInlineData | incompatEncrypt | incompatCasefold

// What ext2 and ext3 know of; a file system with anything more is ext4
// (as blkid names it: libblkid's probe_ext*).
const (
	ext2Incompat  = incompatFiletype | incompatMetaBG
	ext3Incompat  = ext2Incompat | incompatRecover
	ext23ROCompat = roCompatSparseSuper | roCompatLargeFile | roCompatBtreeDir
)

// s_flags: which char signedness the directory hash was computed with.
const flagUnsignedHash = 0x2

// Superblock holds the fields of the ext2/3/4 superblock this package
// uses, named as in the kernel's struct ext4_super_block, and what follows
// from them.
type Superblock struct {
	InodesCount     uint32
	BlocksCount     uint64 // s_blocks_count_lo, and _hi with 64bit
	FirstDataBlock  uint32
	LogBlockSize    uint32
	LogClusterSize  uint32
	BlocksPerGroup  uint32
	InodesPerGroup  uint32
	Magic           uint16
	State           uint16
	RevLevel        uint32
	CreatorOS       uint32
	FirstIno        uint32
	InodeSize       uint16
	FeatureCompat   uint32
	FeatureIncompat uint32
	FeatureROCompat uint32
	UUID            [16]byte
	VolumeName      string
	JournalUUID     [16]byte
	JournalInum     uint32
	HashSeed        [4]uint32
	DefHashVersion  uint8
	DescSize        uint16
	FirstMetaBG     uint32
	Flags           uint32
	ChecksumType    uint8
	BackupBGs       [2]uint32 // sparse_super2
	ChecksumSeed    uint32
	Checksum        uint32

	// Derived.
	BlockSize    uint32
	Groups       uint32 // block groups
	csumSeed     uint32 // crc32c(~0, UUID), or ChecksumSeed with csum_seed
	descPerBlock uint32
}

func (sb *Superblock) metadataCsum() bool { return sb.FeatureROCompat&roCompatMetadataCsum != 0 }

// Type names the file system as blkid does: "ext4" if it has a feature
// ext3 lacks, else "ext3" if it has a journal, else "ext2".
func (sb *Superblock) Type() string {
	switch {
	case sb.FeatureIncompat&^ext3Incompat != 0 || sb.FeatureROCompat&^ext23ROCompat != 0:
		return "ext4"
	case sb.FeatureCompat&compatHasJournal != 0:
		return "ext3"
	}
	return "ext2"
}

// ParseSuperblock decodes and checks the superblock b (the 1024 bytes at
// byte 1024) of a file system of size bytes. It checks what the kernel
// checks before mounting (ext4_fill_super): the geometry, the features it
// must understand, the checksum; and that the blocks it counts fit in size
// bytes, so that no block number it accepts lies outside them.
func ParseSuperblock(b []byte, size int64) (*Superblock, error) {
	bad := func(field string, v uint64, format string, args ...any) error {
		return &guestfs.FormatError{FS: "ext4", Field: "superblock " + field, Value: v, Msg: fmt.Sprintf(format, args...)}
	}
	if len(b) < superblockSize {
		return nil, bad("length", uint64(len(b)), "shorter than %d bytes", superblockSize)
	}
	le := binary.LittleEndian
	sb := &Superblock{
		InodesCount:     le.Uint32(b[0x0:]),
		BlocksCount:     uint64(le.Uint32(b[0x4:])),
		FirstDataBlock:  le.Uint32(b[0x14:]),
		LogBlockSize:    le.Uint32(b[0x18:]),
		LogClusterSize:  le.Uint32(b[0x1C:]),
		BlocksPerGroup:  le.Uint32(b[0x20:]),
		InodesPerGroup:  le.Uint32(b[0x28:]),
		Magic:           le.Uint16(b[0x38:]),
		State:           le.Uint16(b[0x3A:]),
		CreatorOS:       le.Uint32(b[0x48:]),
		RevLevel:        le.Uint32(b[0x4C:]),
		FirstIno:        le.Uint32(b[0x54:]),
		InodeSize:       le.Uint16(b[0x58:]),
		FeatureCompat:   le.Uint32(b[0x5C:]),
		FeatureIncompat: le.Uint32(b[0x60:]),
		FeatureROCompat: le.Uint32(b[0x64:]),
		VolumeName:      string(bytes.TrimRight(b[0x78:0x88], "\x00")),
		JournalInum:     le.Uint32(b[0xE0:]),
		DefHashVersion:  b[0xFC],
		DescSize:        le.Uint16(b[0xFE:]),
		FirstMetaBG:     le.Uint32(b[0x104:]),
		Flags:           le.Uint32(b[0x160:]),
		ChecksumType:    b[0x175],
		BackupBGs:       [2]uint32{le.Uint32(b[0x24C:]), le.Uint32(b[0x250:])},
		ChecksumSeed:    le.Uint32(b[0x270:]),
		Checksum:        le.Uint32(b[0x3FC:]),
	}
	copy(sb.UUID[:], b[0x68:0x78])
	copy(sb.JournalUUID[:], b[0xD0:0xE0])
	for i := range sb.HashSeed {
		sb.HashSeed[i] = le.Uint32(b[0xEC+4*i:])
	}
	if sb.Magic != superMagic {
		return nil, bad("s_magic", uint64(sb.Magic), "not an ext2/3/4 file system (0x%X)", superMagic)
	}
	if sb.metadataCsum() {
		if sb.ChecksumType != 1 {
			return nil, bad("s_checksum_type", uint64(sb.ChecksumType), "not crc32c (1)")
		}
		if c := crc32c(^uint32(0), b[:0x3FC]); c != sb.Checksum {
			return nil, bad("s_checksum", uint64(sb.Checksum), "does not match the superblock's (0x%08x)", c)
		}
	}
	if sb.FeatureIncompat&incompatJournalDev != 0 {
		return nil, &guestfs.UnsupportedError{Type: "jbd", Msg: "an external ext3/ext4 journal, not a file system"}
	}
	if f := sb.FeatureIncompat &^ incompatRead; f != 0 {
		return nil, &guestfs.UnsupportedError{Type: sb.Type(), Msg: fmt.Sprintf("incompatible features 0x%x (%s) are not read", f, incompatNames(f))}
	}
	if sb.FeatureIncompat&incompat64Bit != 0 {
		sb.BlocksCount |= uint64(le.Uint32(b[0x150:])) << 32
	}

	switch sb.RevLevel {
	case 0: // EXT2_GOOD_OLD_REV: fixed inode size and first inode
		sb.InodeSize, sb.FirstIno = 128, 11
	case 1:
	default:
		return nil, bad("s_rev_level", uint64(sb.RevLevel), "not 0 or 1")
	}
	if sb.LogBlockSize > 6 {
		return nil, bad("s_log_block_size", uint64(sb.LogBlockSize), "blocks larger than 64 KiB")
	}
	sb.BlockSize = 1024 << sb.LogBlockSize
	bs := sb.BlockSize
	clusterRatio := uint32(1)
	if sb.FeatureROCompat&roCompatBigalloc != 0 {
		if sb.LogClusterSize < sb.LogBlockSize || sb.LogClusterSize-sb.LogBlockSize > 16 {
			return nil, bad("s_log_cluster_size", uint64(sb.LogClusterSize), "clusters smaller than blocks or more than 2^16 blocks")
		}
		clusterRatio = 1 << (sb.LogClusterSize - sb.LogBlockSize)
	} else if sb.LogClusterSize != sb.LogBlockSize {
		return nil, bad("s_log_cluster_size", uint64(sb.LogClusterSize), "differs from s_log_block_size %d without bigalloc", sb.LogBlockSize)
	}
	if sb.InodeSize < 128 || uint32(sb.InodeSize) > bs || sb.InodeSize&(sb.InodeSize-1) != 0 {
		return nil, bad("s_inode_size", uint64(sb.InodeSize), "not a power of two from 128 to the block size %d", bs)
	}
	if sb.BlocksPerGroup < 8 || sb.BlocksPerGroup%8 != 0 || uint64(sb.BlocksPerGroup) > uint64(bs)*8*uint64(clusterRatio) {
		return nil, bad("s_blocks_per_group", uint64(sb.BlocksPerGroup), "not a multiple of 8 from 8 to %d", uint64(bs)*8*uint64(clusterRatio))
	}
	inodesPerBlock := bs / uint32(sb.InodeSize)
	if sb.InodesPerGroup < inodesPerBlock || sb.InodesPerGroup > bs*8 || sb.InodesPerGroup%inodesPerBlock != 0 {
		return nil, bad("s_inodes_per_group", uint64(sb.InodesPerGroup), "not a multiple of %d inodes a block up to %d", inodesPerBlock, bs*8)
	}
	if max := uint64(size) / uint64(bs); sb.BlocksCount > max || sb.BlocksCount == 0 {
		return nil, bad("s_blocks_count", sb.BlocksCount, "the partition holds %d blocks of %d bytes", max, bs)
	}
	if sb.FirstDataBlock > 1 || uint64(sb.FirstDataBlock) >= sb.BlocksCount {
		return nil, bad("s_first_data_block", uint64(sb.FirstDataBlock), "neither 0 nor 1")
	}
	groups := (sb.BlocksCount - uint64(sb.FirstDataBlock) + uint64(sb.BlocksPerGroup) - 1) / uint64(sb.BlocksPerGroup)
	if groups*uint64(sb.InodesPerGroup) != uint64(sb.InodesCount) {
		return nil, bad("s_inodes_count", uint64(sb.InodesCount), "not %d groups of %d inodes", groups, sb.InodesPerGroup)
	}
	sb.Groups = uint32(groups)
	if sb.FirstIno < 11 || sb.FirstIno >= sb.InodesCount {
		return nil, bad("s_first_ino", uint64(sb.FirstIno), "not from 11 to s_inodes_count %d", sb.InodesCount)
	}
	if sb.FeatureIncompat&incompat64Bit != 0 {
		if sb.DescSize < 64 || uint32(sb.DescSize) > bs || sb.DescSize&(sb.DescSize-1) != 0 {
			return nil, bad("s_desc_size", uint64(sb.DescSize), "not a power of two from 64 to the block size")
		}
	} else {
		sb.DescSize = 32
	}
	sb.descPerBlock = bs / uint32(sb.DescSize)
	if sb.FeatureIncompat&incompatMetaBG != 0 && uint64(sb.FirstMetaBG) > (groups+uint64(sb.descPerBlock)-1)/uint64(sb.descPerBlock) {
		return nil, bad("s_first_meta_bg", uint64(sb.FirstMetaBG), "past the %d group descriptor blocks", (groups+uint64(sb.descPerBlock)-1)/uint64(sb.descPerBlock))
	}
	if sb.FeatureIncompat&incompatCsumSeed != 0 {
		sb.csumSeed = sb.ChecksumSeed
	} else {
		sb.csumSeed = crc32c(^uint32(0), sb.UUID[:])
	}
	return sb, nil
}

// hasSuper says whether block group g holds a copy of the superblock and
// group descriptors (ext4_bg_has_super): every group without
// sparse_super, groups 0, 1 and the powers of 3, 5 and 7 with it, the two
// listed ones with sparse_super2.
func (sb *Superblock) hasSuper(g uint32) bool {
	switch {
	case g == 0:
		return true
	case sb.FeatureCompat&compatSparseSuper2 != 0:
		return g == sb.BackupBGs[0] || g == sb.BackupBGs[1]
	case g <= 1 || sb.FeatureROCompat&roCompatSparseSuper == 0:
		return true
	case g&1 == 0:
		return false
	}
	for _, p := range []uint32{3, 5, 7} {
		n := uint64(p)
		for n < uint64(g) {
			n *= uint64(p)
		}
		if n == uint64(g) {
			return true
		}
	}
	return false
}

// descBlock returns the block that holds group descriptor block n
// (descriptor_loc in the kernel): right after the block of the superblock
// (block 1 with 1 KiB blocks, else 0), or with meta_bg, from
// s_first_meta_bg on, in the first group of its meta group.
func (sb *Superblock) descBlock(n uint32) uint64 {
	if sb.FeatureIncompat&incompatMetaBG == 0 || n < sb.FirstMetaBG {
		return uint64(superblockOffset/sb.BlockSize) + 1 + uint64(n)
	}
	g := n * sb.descPerBlock
	b := uint64(sb.FirstDataBlock) + uint64(g)*uint64(sb.BlocksPerGroup)
	if sb.hasSuper(g) {
		b++
	}
	if sb.BlockSize == 1024 && n == 0 && sb.FirstDataBlock == 0 {
		b++
	}
	return b
}

var incompatFeatureNames = []struct {
	bit  uint32
	name string
}{
	{incompatCompression, "compression"}, {incompatJournalDev, "journal_dev"}, {incompatDirData, "dirdata"},
}

func incompatNames(f uint32) string {
	var s []string
	for _, n := range incompatFeatureNames {
		if f&n.bit != 0 {
			s = append(s, n.name)
			f &^= n.bit
		}
	}
	if f != 0 {
		s = append(s, fmt.Sprintf("unknown 0x%x", f))
	}
	return strings.Join(s, ", ")
}
