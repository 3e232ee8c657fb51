package ext4

import (
	"encoding/binary"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/guestfs"
)

// The journal (jbd2; journal.rst), replayed in memory.
//
// A file system whose superblock says needs_recovery (a guest that was
// running, or crashed, when the image was taken) has transactions in its
// journal that are committed but not yet written to their places. The
// kernel's read-only mount replays them before it shows anything (to the
// device: a read-only mount of such a file system writes), so its files
// are the journal's version. Open does the same without writing: it
// scans the journal the way jbd2's recovery does (fs/jbd2/recovery.c:
// a scan pass to find the last committed transaction, a revoke pass, a
// replay pass), and keeps, for each block the replay would write, where
// its new content is in the journal. Every read of the file system then
// reads those blocks from the journal (device.readBlocks). What Open does
// not do is the orphan cleanup the kernel's mount does next (finishing
// deletes and truncates of files that were open): orphans are unlinked,
// so no path reaches them, and a truncate's blocks past i_size are never
// read.
//
// Where the kernel's recovery fails, so does Open (never a mix of
// replayed and unreplayed blocks): a data block or a commit block whose
// checksum does not match, a revoke block out of bounds, a journal on
// another device, or fast commits to replay (this package does not replay
// them).
//
// All jbd2 fields are big-endian.
const (
	jbd2MagicNumber = 0xC03B3998
	jbdDescriptor   = 1
	jbdCommit       = 2
	jbdSuperV1      = 3
	jbdSuperV2      = 4
	jbdRevoke       = 5

	jCompatChecksum    = 0x1
	jIncompatRevoke    = 0x1
	jIncompat64Bit     = 0x2
	jIncompatAsync     = 0x4
	jIncompatCsumV2    = 0x8
	jIncompatCsumV3    = 0x10
	jIncompatFastCommt = 0x20
	jIncompatKnown     = jIncompatRevoke | jIncompat64Bit | jIncompatAsync | jIncompatCsumV2 | jIncompatCsumV3 | jIncompatFastCommt

	tagEscape   = 0x1
	tagSameUUID = 0x2
	tagLast     = 0x8

	jCRC32C = 4 // s_checksum_type for checksums v2 and v3

	// maxJournalBlocks bounds the journal replayed: the work and the
	// replay map grow with it. mke2fs makes journals of up to 262144
	// blocks (1 GiB of 4 KiB blocks) by default.
	maxJournalBlocks = 1 << 21
)

var jbd2Magic = [4]byte{0xC0, 0x3B, 0x39, 0x98}

// journal is the journal being scanned.
type journal struct {
	fs       *FS
	in       *inode
	maxlen   uint32 // s_maxlen: blocks of the log, superblock included
	first    uint32 // s_first: the first block of the log proper
	seq      uint32 // s_sequence: the first transaction expected
	start    uint32 // s_start: where it is; 0 when nothing needs replay
	compat   uint32
	incompat uint32
	csumSeed uint32 // crc32c(~0, s_uuid)
	tagBytes int
	cur      run // the journal inode's run last mapped
}

func (j *journal) has(incompat uint32) bool { return j.incompat&incompat != 0 }
func (j *journal) csum() bool               { return j.has(jIncompatCsumV2 | jIncompatCsumV3) }

func (j *journal) errorf(field string, v uint64, format string, args ...any) error {
	return j.fs.formatError(j.in.ino, "journal "+field, v, format, args...)
}

// replayJournal returns the blocks jbd2's recovery would write, each
// with where its content is in the journal; none if the journal is clean.
func (fs *FS) replayJournal() (map[uint64]journalBlock, error) {
	sb := fs.sb
	if sb.FeatureCompat&compatHasJournal == 0 {
		return nil, fs.formatError(0, "superblock s_feature_incompat", incompatRecover, "needs_recovery without a journal")
	}
	if sb.JournalInum == 0 {
		return nil, &guestfs.UnsupportedError{Type: fs.typ, Msg: "the journal that needs recovery is on another device"}
	}
	in, err := fs.readInode(uint64(sb.JournalInum))
	if err != nil {
		return nil, fmt.Errorf("%s: journal inode: %w", fs.typ, err)
	}
	if in.fileType() != unix.S_IFREG || in.flags&flagInlineData != 0 {
		return nil, fs.formatError(in.ino, "journal i_mode", uint64(in.mode), "not a regular file with blocks")
	}
	j := &journal{fs: fs, in: in}
	if err := j.readSuperblock(); err != nil {
		return nil, err
	}
	if j.start == 0 {
		return nil, nil // clean: the kernel replays nothing either
	}
	if j.has(jIncompatFastCommt) {
		return nil, &guestfs.UnsupportedError{Type: fs.typ, Msg: "the journal needs recovery and has fast commits, which are not replayed"}
	}
	rec := &recovery{revoked: map[uint64]uint32{}, replay: map[uint64]journalBlock{}}
	for _, p := range []pass{passScan, passRevoke, passReplay} {
		if err := j.pass(p, rec); err != nil {
			return nil, err
		}
	}
	return rec.replay, nil
}

// readSuperblock reads and checks the journal superblock (block 0 of the
// journal inode) as jbd2's journal_load does.
func (j *journal) readSuperblock() error {
	fs := j.fs
	be := binary.BigEndian
	blocks := j.in.size / uint64(fs.sb.BlockSize)
	b, err := j.read(0)
	if err != nil {
		return err
	}
	if m, t := be.Uint32(b), be.Uint32(b[4:]); m != jbd2MagicNumber || t != jbdSuperV1 && t != jbdSuperV2 {
		return j.errorf("superblock h_magic", uint64(m), "not a jbd2 superblock (type %d)", t)
	}
	if bs := be.Uint32(b[0xC:]); bs != fs.sb.BlockSize {
		return j.errorf("s_blocksize", uint64(bs), "not the file system's %d", fs.sb.BlockSize)
	}
	j.maxlen, j.first, j.seq, j.start = be.Uint32(b[0x10:]), be.Uint32(b[0x14:]), be.Uint32(b[0x18:]), be.Uint32(b[0x1C:])
	if uint64(j.maxlen) > blocks {
		return j.errorf("s_maxlen", uint64(j.maxlen), "longer than the journal inode's %d blocks", blocks)
	}
	if j.maxlen > maxJournalBlocks {
		return &guestfs.UnsupportedError{Type: fs.typ, Msg: fmt.Sprintf("a journal of %d blocks needs recovery: more than the %d this package replays", j.maxlen, maxJournalBlocks)}
	}
	if j.first == 0 || j.first >= j.maxlen {
		return j.errorf("s_first", uint64(j.first), "not inside the journal's %d blocks", j.maxlen)
	}
	if j.start != 0 && (j.start < j.first || j.start >= j.maxlen) {
		return j.errorf("s_start", uint64(j.start), "not inside the log, blocks %d to %d", j.first, j.maxlen-1)
	}
	if be.Uint32(b[4:]) == jbdSuperV2 {
		j.compat, j.incompat = be.Uint32(b[0x24:]), be.Uint32(b[0x28:])
	}
	if f := j.incompat &^ jIncompatKnown; f != 0 {
		return &guestfs.UnsupportedError{Type: fs.typ, Msg: fmt.Sprintf("journal incompatible features 0x%x are not known", f)}
	}
	if j.has(jIncompatCsumV2) && j.has(jIncompatCsumV3) {
		return j.errorf("s_feature_incompat", uint64(j.incompat), "checksums v2 and v3 at once")
	}
	if j.csum() {
		if t := b[0x50]; t != jCRC32C {
			return j.errorf("s_checksum_type", uint64(t), "not crc32c (%d)", jCRC32C)
		}
		c := crc32c(^uint32(0), b[:0xFC])
		c = crc32c(c, []byte{0, 0, 0, 0})
		c = crc32c(c, b[0x100:1024])
		if stored := be.Uint32(b[0xFC:]); c != stored {
			return j.errorf("superblock s_checksum", uint64(stored), "does not match the superblock's (0x%08x)", c)
		}
		j.csumSeed = crc32c(^uint32(0), b[0x30:0x40])
	}
	// journal_tag_bytes: tag3 with checksums v3; else the old tag,
	// with a 16-bit checksum under v2, without its high block number
	// unless 64bit.
	switch {
	case j.has(jIncompatCsumV3):
		j.tagBytes = 16
	default:
		j.tagBytes = 12
		if j.has(jIncompatCsumV2) {
			j.tagBytes += 2
		}
		if !j.has(jIncompat64Bit) {
			j.tagBytes -= 4
		}
	}
	return nil
}

// pblk maps block lblk of the journal to the file system's block.
func (j *journal) pblk(lblk uint32) (uint64, error) {
	l := uint64(lblk)
	if l < j.cur.lblk || l >= j.cur.lblk+j.cur.n {
		r, err := j.fs.mapBlock(j.in, l)
		if err != nil {
			return 0, err
		}
		j.cur = r
	}
	if !j.cur.data() {
		return 0, j.errorf("block", l, "a hole in the journal inode")
	}
	return j.cur.pblk + l - j.cur.lblk, nil
}

// read reads block lblk of the journal, as it is on disk.
func (j *journal) read(lblk uint32) ([]byte, error) {
	p, err := j.pblk(lblk)
	if err != nil {
		return nil, err
	}
	b := make([]byte, j.fs.sb.BlockSize)
	if err := j.fs.dev.readBlocks(b, p); err != nil {
		return nil, fmt.Errorf("%s: journal block %d: %w", j.fs.typ, lblk, err)
	}
	return b, nil
}

// wrap keeps a log position inside the log, s_first to s_maxlen-1.
func (j *journal) wrap(pos uint32) uint32 {
	if pos >= j.maxlen {
		pos -= j.maxlen - j.first
	}
	return pos
}

// blockCsum checks the tail checksum of a descriptor or revoke block
// (jbd2_descriptor_block_csum_verify).
func (j *journal) blockCsum(b []byte) bool {
	n := len(b) - 4
	c := crc32c(j.csumSeed, b[:n])
	c = crc32c(c, []byte{0, 0, 0, 0})
	return c == binary.BigEndian.Uint32(b[n:])
}

// commitCsum checks a commit block's checksum (h_chksum[0], over the
// block with it zeroed).
func (j *journal) commitCsum(b []byte) bool {
	c := crc32c(j.csumSeed, b[:0x10])
	c = crc32c(c, []byte{0, 0, 0, 0})
	c = crc32c(c, b[0x14:])
	return c == binary.BigEndian.Uint32(b[0x10:])
}

type pass int

const (
	passScan pass = iota
	passRevoke
	passReplay
)

// recovery is what the passes hand on: where the log ends, the revoked
// blocks with the last transaction that revoked each, the replay.
type recovery struct {
	end     uint32 // the first transaction not replayed
	endSet  bool
	revoked map[uint64]uint32
	replay  map[uint64]journalBlock
}

// tidGT compares transaction IDs modulo 2^32, as jbd2 does.
func tidGT(x, y uint32) bool { return int32(x-y) > 0 }

// tags walks the block tags of descriptor block b: for each, the target
// block, flags and checksum (count_tags, and the loop of do_one_pass).
func (j *journal) tags(b []byte, f func(target uint64, flags uint16, csum uint32) error) error {
	be := binary.BigEndian
	end := len(b)
	if j.csum() {
		end -= 4
	}
	for p := 12; p+j.tagBytes <= end; {
		flags := be.Uint16(b[p+6:])
		target := uint64(be.Uint32(b[p:]))
		if j.has(jIncompat64Bit) {
			target |= uint64(be.Uint32(b[p+8:])) << 32
		}
		var csum uint32
		if j.has(jIncompatCsumV3) {
			csum = be.Uint32(b[p+12:])
		} else {
			csum = uint32(be.Uint16(b[p+4:]))
		}
		if err := f(target, flags, csum); err != nil {
			return err
		}
		p += j.tagBytes
		if flags&tagSameUUID == 0 {
			p += 16
		}
		if flags&tagLast != 0 {
			break
		}
	}
	return nil
}

// pass makes one of recovery's passes over the log (do_one_pass): from
// s_start, transaction s_sequence, block by block, while each block has
// jbd2's magic and the transaction ID expected. At most s_maxlen log
// positions are visited.
func (j *journal) pass(p pass, rec *recovery) error {
	be := binary.BigEndian
	fs := j.fs
	seq, pos := j.seq, j.start
	crc32Sum := ^uint32(0) // v1 transaction checksums
	needCheckCommitTime := false
	var lastCommitTime uint64
	blockError := false
	visited := uint64(0)
	advance := func(n uint64) error {
		visited += n
		if visited > uint64(j.maxlen) {
			return j.errorf("log", visited, "longer than the journal's %d blocks", j.maxlen)
		}
		for ; n > 0; n-- {
			pos = j.wrap(pos + 1)
		}
		return nil
	}
scan:
	for {
		if p != passScan && !tidGT(rec.end, seq) {
			break
		}
		b, err := j.read(pos)
		if err != nil {
			return err
		}
		if err := advance(1); err != nil {
			return err
		}
		if be.Uint32(b) != jbd2MagicNumber || be.Uint32(b[8:]) != seq {
			break
		}
		switch be.Uint32(b[4:]) {
		case jbdDescriptor:
			if j.csum() && !j.blockCsum(b) {
				if p != passScan {
					return j.errorf("descriptor block checksum", uint64(pos), "does not match (transaction %d)", seq)
				}
				// Maybe a stale block from before the journal was
				// reused: the commit time decides (below).
				needCheckCommitTime = true
			}
			var ntags uint64
			_ = j.tags(b, func(uint64, uint16, uint32) error { ntags++; return nil })
			if p == passScan && j.compat&jCompatChecksum != 0 && !needCheckCommitTime && !rec.endSet {
				crc32Sum = crc32BE(crc32Sum, b)
				for i := range ntags {
					d, err := j.read(j.wrap(pos + uint32(i)))
					if err != nil {
						return err
					}
					crc32Sum = crc32BE(crc32Sum, d)
				}
			}
			if p != passReplay {
				if err := advance(ntags); err != nil {
					return err
				}
				continue
			}
			err := j.tags(b, func(target uint64, flags uint16, csum uint32) error {
				at := pos
				if err := advance(1); err != nil {
					return err
				}
				if rs, ok := rec.revoked[target]; ok && !tidGT(seq, rs) {
					return nil
				}
				if target >= fs.sb.BlocksCount {
					return j.errorf("tag t_blocknr", target, "past the file system's %d blocks (transaction %d)", fs.sb.BlocksCount, seq)
				}
				if j.csum() {
					d, err := j.read(at)
					if err != nil {
						return err
					}
					var s [4]byte
					be.PutUint32(s[:], seq)
					c := crc32c(crc32c(j.csumSeed, s[:]), d)
					if !j.has(jIncompatCsumV3) {
						c &= 0xFFFF
					}
					if c != csum {
						blockError = true
						return nil
					}
				}
				pb, err := j.pblk(at)
				if err != nil {
					return err
				}
				rec.replay[target] = journalBlock{pblk: pb, escaped: flags&tagEscape != 0}
				return nil
			})
			if err != nil {
				return err
			}
		case jbdCommit:
			commitTime := be.Uint64(b[0x30:])
			if needCheckCommitTime {
				if commitTime >= lastCommitTime {
					return j.errorf("descriptor or revoke block checksum", uint64(seq), "does not match in a committed transaction")
				}
				break scan // a stale transaction: the log ends before it
			}
			if p == passScan {
				failed := false
				if j.compat&jCompatChecksum != 0 {
					if rec.endSet {
						return j.errorf("commit block", uint64(rec.end), "a transaction after one whose checksum did not match: the kernel refuses to mount")
					}
					found, ctype, csize := be.Uint32(b[0x10:]), b[0xC], b[0xD]
					failed = !(crc32Sum == found && ctype == 1 && csize == 4 || ctype == 0 && csize == 0 && found == 0)
					crc32Sum = ^uint32(0)
				}
				if !failed && j.csum() && !j.commitCsum(b) {
					failed = true
				}
				if failed {
					if commitTime < lastCommitTime {
						break scan // stale, from before the journal wrapped
					}
					// With asynchronous commits a transaction whose
					// commit did not make it whole ends the log;
					// otherwise the kernel takes it for a corrupt
					// journal and does not mount (j_failed_commit).
					if !j.has(jIncompatAsync) {
						return j.errorf("commit block checksum", uint64(seq), "does not match: transaction %d is corrupt, and the kernel refuses to mount", seq)
					}
					rec.end, rec.endSet = seq, true
					break scan
				}
				lastCommitTime = commitTime
			}
			seq++
		case jbdRevoke:
			if p == passScan && j.csum() && !j.blockCsum(b) {
				needCheckCommitTime = true
			}
			if p != passRevoke {
				continue
			}
			if err := j.revoke(b, seq, rec); err != nil {
				return err
			}
		default:
			break scan
		}
	}
	if p == passScan {
		if !rec.endSet {
			rec.end, rec.endSet = seq, true
		}
	} else if seq != rec.end {
		return j.errorf("log", uint64(seq), "pass %d ended at transaction %d, not %d", p, seq, rec.end)
	}
	if blockError {
		return j.errorf("data block checksum", uint64(seq), "a journalled block does not match its tag's checksum: the kernel refuses to mount")
	}
	return nil
}

// revoke records the blocks revoke block b of transaction seq revokes
// (scan_revoke_records).
func (j *journal) revoke(b []byte, seq uint32, rec *recovery) error {
	be := binary.BigEndian
	count := be.Uint32(b[0xC:])
	limit := uint32(len(b))
	if j.csum() {
		limit -= 4
	}
	if count > limit {
		return j.errorf("revoke r_count", uint64(count), "past the block's %d bytes (transaction %d)", limit, seq)
	}
	size := uint32(4)
	if j.has(jIncompat64Bit) {
		size = 8
	}
	for off := uint32(16); off+size <= count; off += size {
		var blk uint64
		if size == 4 {
			blk = uint64(be.Uint32(b[off:]))
		} else {
			blk = be.Uint64(b[off:])
		}
		if old, ok := rec.revoked[blk]; !ok || tidGT(seq, old) {
			rec.revoked[blk] = seq
		}
	}
	return nil
}
