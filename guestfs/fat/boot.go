package fat

import (
	"encoding/binary"
	"fmt"

	"github.com/qcowfs/qcowfs/guestfs"
)

// bootSectorLen is what Open reads of the boot sector: the BPB and the
// FAT12/16 or FAT32 extended fields all lie in its first 512 bytes, the
// smallest logical sector.
const bootSectorLen = 512

// bpb is the BIOS parameter block of the boot sector, its fields named as
// in Microsoft's FAT specification (fatgen103: BPB_BytsPerSec, ...), in
// their on-disk order; all little-endian.
type bpb struct {
	BytsPerSec uint16 // offset 11
	SecPerClus uint8  // 13
	RsvdSecCnt uint16 // 14
	NumFATs    uint8  // 16
	RootEntCnt uint16 // 17
	TotSec16   uint16 // 19
	Media      uint8  // 21
	FATSz16    uint16 // 22
	TotSec32   uint32 // 32
	// FAT32 only (offset 36 on): the FAT's size and the root
	// directory's first cluster.
	FATSz32  uint32 // 36
	RootClus uint32 // 44
	// The extended boot record's volume label, when its signature
	// (BS_BootSig 0x29) says it is there: offset 43 (FAT12/16) or 71
	// (FAT32).
	VolLab string
}

func readBPB(b []byte) bpb {
	le := binary.LittleEndian
	p := bpb{
		BytsPerSec: le.Uint16(b[11:]),
		SecPerClus: b[13],
		RsvdSecCnt: le.Uint16(b[14:]),
		NumFATs:    b[16],
		RootEntCnt: le.Uint16(b[17:]),
		TotSec16:   le.Uint16(b[19:]),
		Media:      b[21],
		FATSz16:    le.Uint16(b[22:]),
		TotSec32:   le.Uint32(b[32:]),
		FATSz32:    le.Uint32(b[36:]),
		RootClus:   le.Uint32(b[44:]),
	}
	sig, lab := 38, 43
	if p.FATSz16 == 0 {
		sig, lab = 66, 71
	}
	if b[sig] == 0x29 {
		p.VolLab = string(b[lab : lab+11])
	}
	return p
}

// geometry is where a FAT file system's parts lie, in bytes from the
// partition's start, as Linux's fat_fill_super computes them from the BPB.
type geometry struct {
	bits        int   // 12, 16 or 32: the width of a FAT entry
	sectorSize  int64 // BPB_BytsPerSec
	clusterSize int64
	fatStart    int64 // the first FAT (the one Linux reads)
	fatLen      int64 // bytes of one FAT
	rootStart   int64 // FAT12/16: the fixed root directory region
	rootEntries int64 // FAT12/16: its entries (BPB_RootEntCnt)
	dataStart   int64 // cluster 2
	maxCluster  uint32
	// clusters [2, maxCluster) exist; their count is maxCluster-2
	rootCluster uint32 // FAT32: the root directory's first cluster
	label       string // BPB volume label, raw
}

// FAT entry values (Linux's BAD_FAT12/16/32: a value at or above the bad
// cluster mark ends a chain, as EOF does).
const (
	firstCluster = 2
	maxFAT12     = 0xFF4      // Linux's MAX_FAT12: more clusters mean FAT16
	maxFAT16     = 0xFFF6     // MAX_FAT16
	maxFAT32     = 0x0FFFFFF6 // MAX_FAT32
)

// Field names of the errors below are the specification's.
func bootErr(field string, v uint64, format string, args ...any) error {
	return &guestfs.FormatError{FS: fsType, Field: field, Value: v, Msg: fmt.Sprintf(format, args...)}
}

// parseBoot checks the boot sector b (at least bootSectorLen bytes) as
// Linux's fat_read_bpb and fat_fill_super do, and lays out a file system
// of size bytes. Where Linux would mount a layout that points past the
// device or has no data area, parseBoot refuses it: every byte this
// package reads lies inside [0, size).
func parseBoot(b []byte, size int64) (*geometry, error) {
	if len(b) < bootSectorLen {
		return nil, bootErr("boot sector length", uint64(len(b)), "shorter than %d bytes", bootSectorLen)
	}
	p := readBPB(b)
	// fat_read_bpb: the checks Linux makes before it mounts.
	if p.RsvdSecCnt == 0 {
		return nil, bootErr("BPB_RsvdSecCnt", 0, "no reserved sectors (not a FAT boot sector)")
	}
	if p.NumFATs == 0 {
		return nil, bootErr("BPB_NumFATs", 0, "no FAT")
	}
	if p.Media != 0xF0 && p.Media < 0xF8 {
		return nil, bootErr("BPB_Media", uint64(p.Media), "not a media descriptor (0xF0, 0xF8-0xFF)")
	}
	ss := int64(p.BytsPerSec)
	if ss < 512 || ss > 4096 || ss&(ss-1) != 0 {
		return nil, bootErr("BPB_BytsPerSec", uint64(ss), "not a power of two from 512 to 4096")
	}
	spc := int64(p.SecPerClus)
	if spc == 0 || spc&(spc-1) != 0 {
		return nil, bootErr("BPB_SecPerClus", uint64(spc), "not a power of two")
	}
	g := &geometry{sectorSize: ss, clusterSize: ss * spc, fatStart: int64(p.RsvdSecCnt) * ss}
	fatSectors := int64(p.FATSz16)
	if fatSectors == 0 {
		// Linux takes a FAT32 by BPB_FATSz16 == 0, whatever its
		// cluster count.
		if p.FATSz32 == 0 {
			return nil, bootErr("BPB_FATSz32", 0, "no FAT sectors (BPB_FATSz16 is 0 too)")
		}
		g.bits, fatSectors, g.rootCluster = 32, int64(p.FATSz32), p.RootClus
	}
	g.fatLen = fatSectors * ss
	// The root directory region follows every FAT, and fills whole
	// sectors.
	if int64(p.RootEntCnt)*32%ss != 0 {
		return nil, bootErr("BPB_RootEntCnt", uint64(p.RootEntCnt), "does not fill whole %d-byte sectors", ss)
	}
	g.rootStart = g.fatStart + int64(p.NumFATs)*g.fatLen
	g.rootEntries = int64(p.RootEntCnt)
	g.dataStart = g.rootStart + g.rootEntries*32
	total := int64(p.TotSec16)
	field := "BPB_TotSec16"
	if total == 0 {
		total, field = int64(p.TotSec32), "BPB_TotSec32"
	}
	if total*ss > size {
		return nil, bootErr(field, uint64(total), "%d-byte sectors, past the end of the partition (%d bytes)", ss, size)
	}
	if g.dataStart >= total*ss {
		return nil, bootErr(field, uint64(total), "no data area: the FATs and root directory end at byte %d", g.dataStart)
	}
	clusters := (total*ss - g.dataStart) / g.clusterSize
	if g.bits == 0 {
		g.bits = 12
		if clusters > maxFAT12 {
			g.bits = 16
		}
	}
	// Clusters past the FAT's reach do not exist (Linux: "check that
	// FAT table does not overflow").
	fatEntries := g.fatLen * 8 / int64(g.bits)
	if fatEntries-firstCluster < clusters {
		clusters = fatEntries - firstCluster
	}
	limit := map[int]int64{12: maxFAT12, 16: maxFAT16, 32: maxFAT32}[g.bits]
	if clusters > limit {
		return nil, bootErr("cluster count", uint64(clusters), "more than FAT%d holds (%d)", g.bits, limit)
	}
	if clusters <= 0 {
		return nil, bootErr("cluster count", 0, "the FAT (%d bytes) holds no cluster", g.fatLen)
	}
	g.maxCluster = uint32(clusters) + firstCluster
	if g.bits == 32 && (g.rootCluster < firstCluster || g.rootCluster >= g.maxCluster) {
		return nil, bootErr("BPB_RootClus", uint64(g.rootCluster), "not a cluster (2 to %d)", g.maxCluster-1)
	}
	g.label = p.VolLab
	return g, nil
}

// clusterOffset is where cluster c (already checked to exist) starts.
func (g *geometry) clusterOffset(c uint32) int64 {
	return g.dataStart + int64(c-firstCluster)*g.clusterSize
}

// Probe says whether boot, the first bytes of a partition, is a FAT boot
// sector this package (and Linux's vfat) would mount, by the checks of
// Linux's fat_read_bpb; Open checks the layout against the partition's
// size besides.
func Probe(boot []byte) bool {
	_, err := parseBoot(boot, 1<<62)
	return err == nil
}
