package guestfs

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// probeBytes is how much of the start Probe reads: past btrfs's
// superblock at 64 KiB and the swap signature of 64 KiB pages.
const probeBytes = 0x10100

// A signature is a magic string at a fixed offset, as blkid finds them
// (util-linux libblkid/src/superblocks/*.c).
type signature struct {
	typ   string
	off   int64
	magic string
}

// signatures are checked in order, those at the very start first: a
// volume format there (LUKS, say) owns the device whatever follows.
var signatures = []signature{
	{"crypto_LUKS", 0, "LUKS\xba\xbe"},
	{"xfs", 0, "XFSB"},
	{"squashfs", 0, "hsqs"},
	{"ntfs", 3, "NTFS    "},
	{"exfat", 3, "EXFAT   "},
	{"BitLocker", 3, "-FVE-FS-"},
	{"LVM2_member", 0x018, "LVM2 001"}, // a LABELONE label in sector 0..3, checked below
	{"LVM2_member", 0x218, "LVM2 001"},
	{"LVM2_member", 0x418, "LVM2 001"},
	{"LVM2_member", 0x618, "LVM2 001"},
	{"linux_raid_member", 0, "\xfc\x4e\x2b\xa9"},    // md superblock 1.1
	{"linux_raid_member", 4096, "\xfc\x4e\x2b\xa9"}, // md superblock 1.2
	{"iso9660", 0x8001, "CD001"},
	{"jfs", 0x8000, "JFS1"},
	{"f2fs", 0x400, "\x10\x20\xf5\xf2"},
	{"erofs", 0x400, "\xe2\xe1\xf5\xe0"},
	{"hfsplus", 0x400, "H+\x00\x04"},
	{"hfsplus", 0x400, "HX\x00\x05"},
	{"swap", 4096 - 10, "SWAPSPACE2"},
	{"swap", 4096 - 10, "SWAP-SPACE"},
	{"swap", 8192 - 10, "SWAPSPACE2"},
	{"swap", 16384 - 10, "SWAPSPACE2"},
	{"swap", 65536 - 10, "SWAPSPACE2"},
	{"btrfs", 0x10040, "_BHRfS_M"},
	{"reiserfs", 0x10034, "ReIsErFs"},
	{"reiserfs", 0x10034, "ReIsEr2Fs"},
	{"reiserfs", 0x10034, "ReIsEr3Fs"},
}

// unsupportedWhy says, for the file systems met most often that no reader
// here reads, what reading them would take.
var unsupportedWhy = map[string]string{
	"xfs":               "reading it would take XFS's allocation-group B+trees (inodes, extents, directories in four formats), v5 CRCs and log replay",
	"btrfs":             "reading it would take btrfs's copy-on-write B-trees, chunk tree (RAID profiles), subvolumes and compressed extents (zlib, lzo, zstd)",
	"ntfs":              "reading it would take NTFS's MFT records, attribute lists, runlists, compressed and resident streams, and the $LogFile",
	"exfat":             "reading it would take exFAT's allocation bitmap, directory entry sets and up-case table",
	"swap":              "swap space holds no files",
	"crypto_LUKS":       "a LUKS volume: its file system is inside, encrypted with a key qcowfs does not have",
	"LVM2_member":       "an LVM physical volume: its logical volumes would need LVM's metadata read first",
	"linux_raid_member": "an md RAID member: the array would need assembling first",
}

// Probe names what r (a partition, or a whole disk), size bytes long,
// holds, by the signatures blkid knows it by, with blkid's names: "ext2",
// "ext3", "ext4", "jbd" (an external journal), "vfat" (FAT12, FAT16 and
// FAT32), and the names of file systems and volumes no reader here reads
// ("xfs", "btrfs", "ntfs", "swap", "crypto_LUKS", "LVM2_member", ...).
// Nothing recognised is ErrNoFS. Probe reads at most the first 65 KiB.
func Probe(r io.ReaderAt, size int64) (string, error) {
	n := min(size, probeBytes)
	if n < 0 {
		n = 0
	}
	b := make([]byte, n)
	if m, err := r.ReadAt(b, 0); m < len(b) {
		if err == nil || errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return "", fmt.Errorf("reading the first %d bytes: %w", n, err)
	}
	at := func(off int64, magic string) bool {
		return off+int64(len(magic)) <= int64(len(b)) && string(b[off:off+int64(len(magic))]) == magic
	}
	for _, s := range signatures {
		if !at(s.off, s.magic) {
			continue
		}
		if s.typ == "LVM2_member" && !at(s.off-0x18, "LABELONE") {
			continue
		}
		return s.typ, nil
	}
	if t := extType(b); t != "" {
		return t, nil
	}
	if isFAT(b) {
		return "vfat", nil
	}
	// md superblocks 0.90 and 1.0 sit near the end of the device.
	if size >= 128<<10 {
		var m [4]byte
		for _, off := range []int64{size&^(64<<10-1) - 64<<10, ((size >> 9) - 16) &^ 7 << 9} {
			if _, err := r.ReadAt(m[:], off); err == nil && (m == [4]byte{0xfc, 0x4e, 0x2b, 0xa9} || m == [4]byte{0xa9, 0x2b, 0x4e, 0xfc}) {
				return "linux_raid_member", nil
			}
		}
	}
	return "", ErrNoFS
}

// extType names an ext2/3/4 superblock at byte 1024 the way blkid does
// (libblkid's superblocks/ext.c): a journal device is "jbd"; anything with
// a feature ext3 lacks is "ext4"; else with a journal "ext3", else "ext2".
func extType(b []byte) string {
	if len(b) < 2048 || binary.LittleEndian.Uint16(b[0x438:]) != 0xEF53 {
		return ""
	}
	le := binary.LittleEndian
	compat, incompat, roCompat := le.Uint32(b[0x45C:]), le.Uint32(b[0x460:]), le.Uint32(b[0x464:])
	const (
		hasJournal   = 0x4
		journalDev   = 0x8
		ext3Incompat = 0x2 | 0x4 | 0x10 // filetype, recover, meta_bg
		ext3ROCompat = 0x1 | 0x2 | 0x4  // sparse_super, large_file, btree_dir
	)
	switch {
	case incompat&journalDev != 0:
		return "jbd"
	case incompat&^ext3Incompat != 0 || roCompat&^ext3ROCompat != 0:
		return "ext4"
	case compat&hasJournal != 0:
		return "ext3"
	}
	return "ext2"
}

// isFAT says whether b starts with a FAT boot sector: a jump instruction,
// and a BIOS parameter block whose sector size, cluster size, reserved
// sectors, FAT count and media byte are ones a FAT can have (the checks
// of blkid's probe_vfat and the kernel's fat_read_bpb). NTFS and exFAT,
// which look alike, were ruled out by their signatures before.
func isFAT(b []byte) bool {
	if len(b) < 512 || b[510] != 0x55 || b[511] != 0xAA {
		return false
	}
	if !(b[0] == 0xEB && b[2] == 0x90 || b[0] == 0xE9) {
		return false
	}
	le := binary.LittleEndian
	bps := le.Uint16(b[11:])
	spc := b[13]
	reserved := le.Uint16(b[14:])
	fats := b[16]
	media := b[21]
	total := uint32(le.Uint16(b[19:]))
	if total == 0 {
		total = le.Uint32(b[32:])
	}
	switch {
	case bps < 512 || bps > 4096 || bps&(bps-1) != 0:
		return false
	case spc == 0 || spc&(spc-1) != 0:
		return false
	case reserved == 0 || fats == 0 || fats > 4 || total == 0:
		return false
	case media != 0xF0 && media < 0xF8:
		return false
	}
	// A FAT32 BPB says so at 0x52, a FAT12/16 one at 0x36; old
	// formatters wrote neither, so the string only confirms.
	return bytes.HasPrefix(b[0x52:], []byte("FAT32")) || bytes.HasPrefix(b[0x36:], []byte("FAT1")) || le.Uint16(b[22:]) != 0 || le.Uint32(b[36:]) != 0
}
