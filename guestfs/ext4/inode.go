package ext4

import (
	"encoding/binary"
	"fmt"
	"time"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/guestfs"
)

// Inode fields (inodes.rst, "struct ext4_inode"), little-endian.
const (
	iMode          = 0x00
	iUIDLo         = 0x02
	iSizeLo        = 0x04
	iAtime         = 0x08
	iCtime         = 0x0C
	iMtime         = 0x10
	iGIDLo         = 0x18
	iLinksCount    = 0x1A
	iBlocksLo      = 0x1C
	iFlags         = 0x20
	iBlock         = 0x28 // 60 bytes: extent root, block pointers, or inline data
	iGeneration    = 0x64
	iFileACLLo     = 0x68
	iSizeHigh      = 0x6C
	iBlocksHigh    = 0x74
	iFileACLHigh   = 0x76
	iUIDHigh       = 0x78
	iGIDHigh       = 0x7A
	iChecksumLo    = 0x7C
	iExtraIsize    = 0x80
	iChecksumHi    = 0x82
	iCtimeExtra    = 0x84
	iMtimeExtra    = 0x88
	iAtimeExtra    = 0x8C
	iCrtime        = 0x90
	iCrtimeExtra   = 0x94
	goodOldInode   = 128
	iBlockLen      = 60
	xattrMagic     = 0xEA020000
	maxSymlinkSize = 4095 // PATH_MAX less the NUL: no longer target can be made
)

// i_flags.
const (
	flagIndex      = 0x1000 // a hashed (htree) directory
	flagEncrypt    = 0x800
	flagHugeFile   = 0x40000 // i_blocks counts file system blocks
	flagExtents    = 0x80000
	flagEAInode    = 0x200000
	flagInlineData = 0x10000000
	flagCasefold   = 0x40000000
)

// inode is an inode as read from its table, checked.
type inode struct {
	ino        uint64
	mode       uint16
	uid, gid   uint32
	size       uint64
	links      uint16
	blocks     uint64 // st_blocks: 512-byte units
	flags      uint32
	block      [iBlockLen]byte
	generation uint32
	fileACL    uint64

	atime, ctime, mtime, crtime time.Time
	// inlineData is the system.data extended attribute of an inode with
	// inline data: the bytes past the first 60, which are in block.
	inlineData []byte
	// csumSeed seeds the checksums of the inode's extent tree and
	// directory blocks: CRC-32C of the file system's seed, the inode
	// number and the generation.
	csumSeed uint32
}

func (in *inode) fileType() uint32 { return uint32(in.mode) & unix.S_IFMT }
func (in *inode) isDir() bool      { return in.fileType() == unix.S_IFDIR }

// readInode reads inode ino from its group's inode table and checks it
// as the kernel does when it loads one (__ext4_iget): checksum, mode,
// extra size, size, link count.
func (fs *FS) readInode(ino uint64) (*inode, error) {
	sb := fs.sb
	if ino == 0 || ino > uint64(sb.InodesCount) {
		return nil, fs.formatError(ino, "inode number", ino, "not from 1 to s_inodes_count %d", sb.InodesCount)
	}
	g := uint32((ino - 1) / uint64(sb.InodesPerGroup))
	table, err := fs.inodeTable(g)
	if err != nil {
		return nil, err
	}
	off := (ino - 1) % uint64(sb.InodesPerGroup) * uint64(sb.InodeSize)
	blk, err := fs.dev.block(table + off/uint64(sb.BlockSize))
	if err != nil {
		return nil, fmt.Errorf("%s: inode %d: %w", fs.typ, ino, err)
	}
	return fs.parseInode(ino, blk[off%uint64(sb.BlockSize):][:sb.InodeSize])
}

// parseInode decodes raw, the s_inode_size bytes of inode ino.
func (fs *FS) parseInode(ino uint64, raw []byte) (*inode, error) {
	sb := fs.sb
	le := binary.LittleEndian
	bad := func(field string, v uint64, format string, args ...any) error {
		return fs.formatError(ino, field, v, format, args...)
	}
	extra := uint16(0)
	if len(raw) > goodOldInode {
		extra = le.Uint16(raw[iExtraIsize:])
		if goodOldInode+int(extra) > len(raw) || extra%4 != 0 {
			return nil, bad("i_extra_isize", uint64(extra), "not a multiple of 4 that fits in the %d-byte inode", len(raw))
		}
	}
	// fits says whether a field of the large inode ends within
	// i_extra_isize (EXT4_FITS_IN_INODE).
	fits := func(off, n int) bool { return len(raw) > goodOldInode && off+n <= goodOldInode+int(extra) }

	in := &inode{
		ino:        ino,
		mode:       le.Uint16(raw[iMode:]),
		uid:        uint32(le.Uint16(raw[iUIDLo:])) | uint32(le.Uint16(raw[iUIDHigh:]))<<16,
		gid:        uint32(le.Uint16(raw[iGIDLo:])) | uint32(le.Uint16(raw[iGIDHigh:]))<<16,
		size:       uint64(le.Uint32(raw[iSizeLo:])),
		links:      le.Uint16(raw[iLinksCount:]),
		flags:      le.Uint32(raw[iFlags:]),
		generation: le.Uint32(raw[iGeneration:]),
		fileACL:    uint64(le.Uint32(raw[iFileACLLo:])) | uint64(le.Uint16(raw[iFileACLHigh:]))<<32,
	}
	copy(in.block[:], raw[iBlock:])

	if sb.metadataCsum() {
		in.csumSeed = crc32cLE32(crc32cLE32(sb.csumSeed, uint32(ino)), in.generation)
		if sb.CreatorOS == 0 { // EXT4_OS_LINUX: others keep no checksum here
			c := crc32c(in.csumSeed, raw[:iChecksumLo])
			c = crc32c(c, []byte{0, 0})
			c = crc32c(c, raw[iChecksumLo+2:min(len(raw), iChecksumHi)])
			stored := uint32(le.Uint16(raw[iChecksumLo:]))
			if len(raw) > goodOldInode {
				if fits(iChecksumHi, 2) {
					c = crc32c(c, []byte{0, 0})
					c = crc32c(c, raw[iChecksumHi+2:])
					stored |= uint32(le.Uint16(raw[iChecksumHi:])) << 16
				} else {
					c = crc32c(c, raw[iChecksumHi:])
					c &= 0xFFFF
				}
			} else {
				c &= 0xFFFF
			}
			if c != stored {
				return nil, bad("i_checksum", uint64(stored), "does not match the inode's (0x%x)", c)
			}
		}
	}

	switch in.fileType() {
	case unix.S_IFREG, unix.S_IFDIR, unix.S_IFLNK, unix.S_IFCHR, unix.S_IFBLK, unix.S_IFIFO, unix.S_IFSOCK:
	default:
		if in.links == 0 {
			return nil, bad("i_links_count", 0, "a deleted or unused inode")
		}
		return nil, bad("i_mode", uint64(in.mode), "no file type")
	}
	if in.links == 0 {
		return nil, bad("i_links_count", 0, "a deleted inode")
	}
	// i_size_high counts for regular files, and for directories with
	// largedir (ext4_isize).
	if in.fileType() == unix.S_IFREG || sb.FeatureIncompat&incompatLargeDir != 0 {
		in.size |= uint64(le.Uint32(raw[iSizeHigh:])) << 32
	}
	if int64(in.size) < 0 {
		return nil, bad("i_size", in.size, "negative")
	}

	in.blocks = uint64(le.Uint32(raw[iBlocksLo:]))
	if sb.FeatureROCompat&roCompatHugeFile != 0 {
		in.blocks |= uint64(le.Uint16(raw[iBlocksHigh:])) << 32
		if in.flags&flagHugeFile != 0 {
			in.blocks *= uint64(sb.BlockSize / 512)
		}
	}

	timeAt := func(sec, extraOff int) time.Time {
		s := int64(int32(le.Uint32(raw[sec:])))
		var ns int64
		if extraOff != 0 && fits(extraOff, 4) {
			x := le.Uint32(raw[extraOff:])
			s += int64(x&3) << 32
			ns = int64(x >> 2)
		}
		return time.Unix(s, ns)
	}
	in.atime = timeAt(iAtime, iAtimeExtra)
	in.ctime = timeAt(iCtime, iCtimeExtra)
	in.mtime = timeAt(iMtime, iMtimeExtra)
	if fits(iCrtime, 4) {
		in.crtime = timeAt(iCrtime, iCrtimeExtra)
	}

	if in.flags&flagInlineData != 0 {
		if sb.FeatureIncompat&incompatInlineData == 0 {
			return nil, bad("i_flags", uint64(in.flags), "inline data on a file system without the inline_data feature")
		}
		if err := in.readInlineData(fs, raw[goodOldInode+int(extra):]); err != nil {
			return nil, err
		}
	}
	return in, nil
}

// readInlineData finds the system.data attribute among the inode's
// in-inode extended attributes (attributes.rst: a 4-byte magic, then
// entries, each naming where in the area its value is). The attribute
// must be there, even if empty (inlinedata.rst).
func (in *inode) readInlineData(fs *FS, area []byte) error {
	le := binary.LittleEndian
	bad := func(field string, v uint64, format string, args ...any) error {
		return fs.formatError(in.ino, field, v, format, args...)
	}
	if len(area) < 4 || le.Uint32(area) != xattrMagic {
		return bad("inline data", 0, "no in-inode extended attributes to hold system.data")
	}
	area = area[4:]
	for off := 0; off+16 <= len(area) && le.Uint32(area[off:]) != 0; {
		nameLen, index := int(area[off]), area[off+1]
		valueOff, valueInum, valueSize := int(le.Uint16(area[off+2:])), le.Uint32(area[off+4:]), le.Uint32(area[off+8:])
		if off+16+nameLen > len(area) {
			return bad("xattr e_name_len", uint64(nameLen), "past the inode")
		}
		name := area[off+16 : off+16+nameLen]
		if index == 7 && string(name) == "data" { // "system." + "data"
			if valueInum != 0 || uint64(valueOff)+uint64(valueSize) > uint64(len(area)) {
				return bad("system.data e_value_offs", uint64(valueOff), "a value of %d bytes there is not in the inode", valueSize)
			}
			// A size past the inline data reads as zeros there, as on
			// the kernel's mount (mkfs.ext4 -d makes such files of
			// files that are all zeros).
			in.inlineData = append([]byte(nil), area[valueOff:valueOff+int(valueSize)]...)
			return nil
		}
		off += (16 + nameLen + 3) &^ 3
	}
	return bad("inline data", 0, "no system.data extended attribute")
}

// stat is the inode as guestfs.Stat shows it: what stat(2) on the
// kernel's mount says.
func (fs *FS) stat(in *inode) guestfs.Stat {
	st := guestfs.Stat{
		Ino:    in.ino,
		Nlink:  uint32(in.links),
		Mode:   uint32(in.mode),
		Uid:    in.uid,
		Gid:    in.gid,
		Size:   int64(in.size),
		Blocks: int64(in.blocks),
		Atime:  in.atime,
		Mtime:  in.mtime,
		Ctime:  in.ctime,
		Btime:  in.crtime,
	}
	if t := in.fileType(); t == unix.S_IFCHR || t == unix.S_IFBLK {
		st.Rdev = in.rdev()
	}
	// The kernel counts a sector for each 512 bytes of a regular file
	// with inline data, "so tools like tar, rsync, others don't
	// incorrectly think the file is completely sparse" (ext4_file_getattr).
	if in.flags&flagInlineData != 0 && in.fileType() == unix.S_IFREG {
		st.Blocks += (st.Size + 511) >> 9
	}
	return st
}

// rdev decodes a device node's number from i_block (ext4_iget):
// the old 16-bit encoding in the first word, or the new one in the second.
func (in *inode) rdev() uint64 {
	le := binary.LittleEndian
	if old := le.Uint32(in.block[0:]); old != 0 {
		return unix.Mkdev((old>>8)&0xff, old&0xff)
	}
	d := le.Uint32(in.block[4:])
	return unix.Mkdev((d&0xfff00)>>8, (d&0xff)|((d>>12)&0xfff00))
}
