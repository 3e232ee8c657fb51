package ext4

import (
	"encoding/binary"
)

// Hashed (htree) directories (directory.rst, "Hash Tree Directories"):
// block 0 holds "." and "..", whose record hides struct dx_root_info and
// an array of (hash, block) entries; with one or two more levels of index
// nodes (three with largedir), each a block of entries behind a fake empty
// entry; the leaves are ordinary directory blocks, each holding the names
// whose hashes fall between its entry's hash and the next one's.
//
// A listing reads every block in order (the index blocks read as empty),
// as ext2 would; a lookup goes down the index by the name's hash, as the
// kernel's ext4_dx_find_entry does, and reads one leaf, or a few when
// names collide. An index this package cannot use (an unknown hash, a
// limit that does not match the block size) is not an error: the kernel
// then searches linearly (ERR_BAD_DX_DIR), and so does lookup. A checksum
// that does not match is.

const (
	dxRootCount = 0x20 // where dx_root's count and limit are
	dxNodeCount = 0x08 // and dx_node's
	dxTailLen   = 8
)

// isDx says whether dir is looked up through its hash index (is_dx).
func (fs *FS) isDx(dir *inode) bool {
	return fs.sb.FeatureCompat&compatDirIndex != 0 && dir.flags&flagIndex != 0 && dir.flags&flagInlineData == 0
}

// dxCountOffset finds the count/limit pair of index block b
// (get_dx_countlimit): after "." and ".." and dx_root_info in a root,
// after the fake entry in a node; -1 if b is neither.
func (fs *FS) dxCountOffset(b []byte) int {
	le := binary.LittleEndian
	switch fs.recLen(le.Uint16(b[4:])) {
	case len(b):
		return dxNodeCount
	case 12:
		if fs.recLen(le.Uint16(b[12+4:])) != len(b)-12 || le.Uint32(b[0x18:]) != 0 || b[0x1D] != 8 {
			return -1
		}
		return dxRootCount
	}
	return -1
}

// dxChecksum checks index block b's dx_tail (ext4_dx_csum_verify): over
// the header and the entries in use, then the tail with its checksum
// zeroed.
func (fs *FS) dxChecksum(dir *inode, b []byte, lblk uint64) error {
	le := binary.LittleEndian
	off := fs.dxCountOffset(b)
	if off < 0 {
		return fs.formatError(dir.ino, "htree block", lblk, "neither an index root nor an index node")
	}
	limit, count := int(le.Uint16(b[off:])), int(le.Uint16(b[off+2:]))
	if off+8*limit > len(b)-dxTailLen || count > limit {
		return fs.formatError(dir.ino, "htree limit", uint64(limit), "no room for the checksum, or count %d above it (block %d)", count, lblk)
	}
	t := b[off+8*limit:]
	c := crc32c(dir.csumSeed, b[:off+8*count])
	c = crc32c(c, t[:4])
	c = crc32c(c, []byte{0, 0, 0, 0}) // dt_checksum, as zeros
	if stored := le.Uint32(t[4:]); c != stored {
		return fs.formatError(dir.ino, "htree block checksum", uint64(stored), "does not match logical block %d's (0x%x)", lblk, c)
	}
	return nil
}

// dxFrame is one level of the path down the index: a block, where its
// entries start, how many there are, and the one taken.
type dxFrame struct {
	b         []byte
	off       int
	count, at int
}

func (f *dxFrame) hash(i int) uint32 {
	return binary.LittleEndian.Uint32(f.b[f.off+8*i:])
}

func (f *dxFrame) block(i int) uint64 {
	return uint64(binary.LittleEndian.Uint32(f.b[f.off+8*i+4:]) & 0x0fffffff)
}

// lookupDx finds name in hashed directory dir. usable is false when the
// index cannot be used and the caller must search linearly.
func (fs *FS) lookupDx(dir *inode, name string) (ino uint32, found, usable bool, err error) {
	sb := fs.sb
	nblocks := fs.dirBlocks(dir)
	read := func(lblk uint64) ([]byte, error) {
		if lblk >= nblocks {
			return nil, fs.formatError(dir.ino, "htree block", lblk, "past the directory's %d blocks", nblocks)
		}
		r, err := fs.mapBlock(dir, lblk)
		if err != nil {
			return nil, err
		}
		if !r.data() {
			return nil, fs.formatError(dir.ino, "htree block", lblk, "a hole in the directory")
		}
		return fs.dirBlock(dir, r, lblk)
	}
	root, err := read(0)
	if err != nil {
		return 0, false, true, err
	}
	if fs.dxCountOffset(root) != dxRootCount {
		return 0, false, false, nil
	}
	version, levels, flags := int(root[0x1C]), int(root[0x1E]), root[0x1F]
	maxLevels := 2
	if sb.FeatureIncompat&incompatLargeDir != 0 {
		maxLevels = 3
	}
	if levels >= maxLevels || flags&1 != 0 || version > hashTea || dir.flags&flagCasefold != 0 {
		return 0, false, false, nil
	}
	if sb.Flags&flagUnsignedHash != 0 {
		version += hashLegacyUnsigned
	}
	hash, _ := dxHash([]byte(name), version, sb.HashSeed)

	tail := 0
	if sb.metadataCsum() {
		tail = dxTailLen
	}
	rootLimit := (len(root) - dxRootCount - tail) / 8
	nodeLimit := (len(root) - dxNodeCount - tail) / 8
	frame := func(b []byte, off, limit int) (dxFrame, bool) {
		l, c := int(binary.LittleEndian.Uint16(b[off:])), int(binary.LittleEndian.Uint16(b[off+2:]))
		return dxFrame{b: b, off: off, count: c}, l == limit && c > 0 && c <= l
	}

	// Down the index by hash: in each block, the last entry whose hash
	// is at most the name's (entry 0 stands for the lowest hashes).
	path := make([]dxFrame, levels+1)
	f, ok := frame(root, dxRootCount, rootLimit)
	for level := 0; ; level++ {
		if !ok {
			return 0, false, false, nil
		}
		lo, hi := 1, f.count-1
		for lo <= hi {
			if m := (lo + hi) / 2; f.hash(m) > hash {
				hi = m - 1
			} else {
				lo = m + 1
			}
		}
		f.at = lo - 1
		path[level] = f
		if level == levels {
			break
		}
		b, err := read(f.block(f.at))
		if err != nil {
			return 0, false, true, err
		}
		f, ok = frame(b, dxNodeCount, nodeLimit)
	}

	// Search the leaf; names whose hashes collide may go on into the
	// next leaves, whose index entries then have the lowest bit set
	// (ext4_htree_next_block).
	for visits := uint64(0); visits < nblocks; visits++ {
		leaf := path[levels].block(path[levels].at)
		b, err := read(leaf)
		if err != nil {
			return 0, false, true, err
		}
		_, err = fs.walkEntries(dir, b, region{lblk: leaf}, func(i uint32, n []byte, _ uint8) bool {
			if string(n) == name {
				ino = i
				return false
			}
			return true
		})
		if err != nil || ino != 0 {
			return ino, ino != 0, true, err
		}
		level := levels
		for level >= 0 && path[level].at+1 >= path[level].count {
			level--
		}
		if level < 0 {
			return 0, false, true, nil
		}
		path[level].at++
		if path[level].hash(path[level].at)&^1 != hash {
			return 0, false, true, nil
		}
		for ; level < levels; level++ {
			b, err := read(path[level].block(path[level].at))
			if err != nil {
				return 0, false, true, err
			}
			f, ok := frame(b, dxNodeCount, nodeLimit)
			if !ok {
				return 0, false, true, fs.formatError(dir.ino, "htree node limit", uint64(binary.LittleEndian.Uint16(b[dxNodeCount:])), "not %d, or a count above it", nodeLimit)
			}
			path[level+1] = f
		}
	}
	return 0, false, true, fs.formatError(dir.ino, "htree", nblocks, "the leaves of one hash run on past the directory's blocks")
}
