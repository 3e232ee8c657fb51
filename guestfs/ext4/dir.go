package ext4

import (
	"encoding/binary"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/guestfs"
)

// Directory blocks (directory.rst): entries of inode (4 bytes), rec_len
// (2), name_len (1, or 2 without the filetype feature), file_type (1) and
// the name, each 4-byte aligned, the last one running to the end of the
// block. With metadata_csum a leaf block ends in a 12-byte fake entry that
// holds its checksum; an htree's index blocks hide inside fake entries and
// have a checksum tail of their own (htree.go).
const (
	direntHeader  = 8
	dirTailLen    = 12
	dirTailFT     = 0xDE
	maxNameLen    = 255
	maxDirEntries = 1 << 22 // ReadDirIno refuses a larger directory
)

// fileTypes maps a directory entry's file_type to S_IFMT bits.
var fileTypes = [8]uint32{0, unix.S_IFREG, unix.S_IFDIR, unix.S_IFCHR, unix.S_IFBLK, unix.S_IFIFO, unix.S_IFSOCK, unix.S_IFLNK}

// A region names the entries walkEntries walks, for its errors: a
// directory block, or part of an inline directory.
type region struct {
	inline string // "" for block lblk
	lblk   uint64
}

func (r region) String() string {
	if r.inline != "" {
		return r.inline
	}
	return fmt.Sprintf("directory block %d", r.lblk)
}

// An entryFunc sees one entry; returning false stops the walk. name is
// only valid during the call.
type entryFunc func(ino uint32, name []byte, ftype uint8) bool

// walkEntries calls f for each entry in use in b, a directory block of
// dir (or an inline-data region), as ext4_check_dir_entry checks them:
// rec_len at least the entry's size, 4-aligned, inside the block; the name
// inside rec_len; the inode number in range. where names the block for
// errors. It returns false if f stopped it.
func (fs *FS) walkEntries(dir *inode, b []byte, where region, f entryFunc) (bool, error) {
	le := binary.LittleEndian
	for off := 0; off < len(b); {
		if len(b)-off < direntHeader {
			return true, fs.formatError(dir.ino, "directory entry", uint64(off), "%d bytes left in %s, less than an entry's header", len(b)-off, where)
		}
		e := b[off:]
		ino := le.Uint32(e)
		recLen := fs.recLen(le.Uint16(e[4:]))
		nameLen := int(e[6])
		ftype := e[7]
		if fs.sb.FeatureIncompat&incompatFiletype == 0 {
			nameLen, ftype = int(le.Uint16(e[6:])), 0
		}
		switch {
		case recLen < direntHeader+4 || recLen%4 != 0:
			return true, fs.formatError(dir.ino, "directory entry rec_len", uint64(recLen), "too short or not a multiple of 4 (at byte %d of %s)", off, where)
		case recLen > len(b)-off:
			return true, fs.formatError(dir.ino, "directory entry rec_len", uint64(recLen), "past the end of %s (at byte %d)", where, off)
		case direntHeader+nameLen > recLen || nameLen > maxNameLen:
			return true, fs.formatError(dir.ino, "directory entry name_len", uint64(nameLen), "longer than its record of %d bytes (at byte %d of %s)", recLen, off, where)
		case ino > fs.sb.InodesCount:
			return true, fs.formatError(dir.ino, "directory entry inode", uint64(ino), "past s_inodes_count %d (at byte %d of %s)", fs.sb.InodesCount, off, where)
		}
		if ino != 0 && nameLen > 0 {
			if !f(ino, e[direntHeader:direntHeader+nameLen], ftype) {
				return false, nil
			}
		}
		off += recLen
	}
	return true, nil
}

// recLen decodes rec_len: with 64 KiB blocks, 65536 does not fit in 16
// bits and is stored as 65535 or 0 (ext4_rec_len_from_disk).
func (fs *FS) recLen(v uint16) int {
	if fs.sb.BlockSize < 65536 {
		return int(v)
	}
	if v == 65535 || v == 0 {
		return int(fs.sb.BlockSize)
	}
	return int(v&65532) | int(v&3)<<16
}

// dirBlock reads logical block lblk of directory dir, mapped by run r,
// and checks its checksum with metadata_csum (__ext4_read_dirblock).
func (fs *FS) dirBlock(dir *inode, r run, lblk uint64) ([]byte, error) {
	pblk := r.pblk + lblk - r.lblk
	b, err := fs.dev.block(pblk)
	if err != nil {
		return nil, fmt.Errorf("%s: directory inode %d block %d: %w", fs.typ, dir.ino, lblk, err)
	}
	if !fs.sb.metadataCsum() {
		return b, nil
	}
	if fs.isDx(dir) && (lblk == 0 || fs.recLen(binary.LittleEndian.Uint16(b[4:])) == len(b)) {
		return b, fs.dxChecksum(dir, b, lblk)
	}
	t := b[len(b)-dirTailLen:]
	le := binary.LittleEndian
	if le.Uint32(t) != 0 || le.Uint16(t[4:]) != dirTailLen || t[6] != 0 || t[7] != dirTailFT {
		// The kernel refuses a leaf with no checksum tail too
		// (ext4_dirblock_csum_verify; e2fsck -D makes room for one).
		return nil, fs.formatError(dir.ino, "directory block checksum tail", uint64(lblk), "missing at the end of the block")
	}
	stored := le.Uint32(t[8:])
	if c := crc32c(dir.csumSeed, b[:len(b)-dirTailLen]); c != stored {
		return nil, fs.formatError(dir.ino, "directory block checksum", uint64(stored), "does not match logical block %d's (0x%x)", lblk, c)
	}
	return b, nil
}

// dirBlocks returns the number of blocks of directory dir, bounded.
func (fs *FS) dirBlocks(dir *inode) uint64 {
	return (dir.size + uint64(fs.sb.BlockSize) - 1) / uint64(fs.sb.BlockSize)
}

// forEachEntry calls f for every entry of directory dir, "." and ".."
// included, block by block in the order they are stored (holes, which
// the kernel's readdir skips, are skipped), or for an inline directory,
// its parent as ".." and then the entries in i_block and system.data.
func (fs *FS) forEachEntry(dir *inode, f entryFunc) error {
	if err := fs.checkDirReadable(dir); err != nil {
		return err
	}
	if dir.flags&flagInlineData != 0 {
		return fs.forEachInlineEntry(dir, f)
	}
	n := fs.dirBlocks(dir)
	for lblk := uint64(0); lblk < n; {
		r, err := fs.mapBlock(dir, lblk)
		if err != nil {
			return err
		}
		end := min(n, r.lblk+r.n)
		if !r.data() {
			lblk = end
			continue
		}
		for ; lblk < end; lblk++ {
			b, err := fs.dirBlock(dir, r, lblk)
			if err != nil {
				return err
			}
			more, err := fs.walkEntries(dir, b, region{lblk: lblk}, f)
			if err != nil || !more {
				return err
			}
		}
	}
	return nil
}

// forEachInlineEntry walks an inline directory (inlinedata.rst): i_block
// starts with the parent's inode number, then entries fill the rest of
// i_block and, separately, the system.data value. There are no "." and
// ".." entries; they are made up, as the kernel's readdir does.
func (fs *FS) forEachInlineEntry(dir *inode, f entryFunc) error {
	parent := binary.LittleEndian.Uint32(dir.block[:4])
	if parent == 0 || parent > fs.sb.InodesCount {
		return fs.formatError(dir.ino, "inline directory parent", uint64(parent), "not an inode number")
	}
	if !f(uint32(dir.ino), []byte("."), 2) || !f(parent, []byte(".."), 2) {
		return nil
	}
	more, err := fs.walkEntries(dir, dir.block[4:], region{inline: "the inline directory in i_block"}, f)
	if err != nil || !more || len(dir.inlineData) == 0 {
		return err
	}
	_, err = fs.walkEntries(dir, dir.inlineData, region{inline: "the inline directory in system.data"}, f)
	return err
}

// checkDirReadable refuses directories whose names this package cannot
// read: encrypted ones.
func (fs *FS) checkDirReadable(dir *inode) error {
	if !dir.isDir() {
		return fs.notDir(dir.ino)
	}
	if dir.flags&flagEncrypt != 0 {
		return &guestfs.UnsupportedError{Type: fs.typ, Msg: fmt.Sprintf("inode %d: an encrypted directory (fscrypt): its names cannot be read without the key", dir.ino)}
	}
	return nil
}

// readDir lists directory dir without "." and "..".
func (fs *FS) readDir(dir *inode) ([]guestfs.DirEntry, error) {
	var list []guestfs.DirEntry
	var tooMany bool
	err := fs.forEachEntry(dir, func(ino uint32, name []byte, ftype uint8) bool {
		if isDots(name) {
			return true
		}
		if len(list) >= maxDirEntries {
			tooMany = true
			return false
		}
		list = append(list, guestfs.DirEntry{Name: string(name), Ino: uint64(ino), Type: fileTypes[ftype&7]})
		return true
	})
	if err == nil && tooMany {
		err = fs.formatError(dir.ino, "directory entries", maxDirEntries, "more than this package lists")
	}
	return list, err
}

func isDots(name []byte) bool {
	return len(name) == 1 && name[0] == '.' || len(name) == 2 && name[0] == '.' && name[1] == '.'
}

// lookupLinear finds name in directory dir entry by entry. "." and ".."
// are only looked for in the first block, where they are (ext4_find_entry).
func (fs *FS) lookupLinear(dir *inode, name string) (uint32, bool, error) {
	var found uint32
	if isDots([]byte(name)) && dir.flags&flagInlineData == 0 {
		r, err := fs.mapBlock(dir, 0)
		if err != nil || !r.data() || dir.size == 0 {
			if err == nil {
				err = fs.formatError(dir.ino, "directory block 0", 0, "a hole: no \".\" or \"..\" entry")
			}
			return 0, false, err
		}
		b, err := fs.dirBlock(dir, r, 0)
		if err != nil {
			return 0, false, err
		}
		_, err = fs.walkEntries(dir, b, region{}, func(ino uint32, n []byte, _ uint8) bool {
			if string(n) == name {
				found = ino
				return false
			}
			return true
		})
		return found, found != 0, err
	}
	err := fs.forEachEntry(dir, func(ino uint32, n []byte, _ uint8) bool {
		if string(n) == name {
			found = ino
			return false
		}
		return true
	})
	return found, found != 0, err
}
