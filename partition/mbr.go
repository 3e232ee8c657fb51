package partition

import (
	"encoding/binary"
	"fmt"
)

// mbrSize is the size of an MBR or EBR: the first 512 bytes of its block,
// whatever the block size.
const mbrSize = 512

// MBR OSType values with a meaning for the layout.
const (
	typeEmpty          = 0x00
	typeExtended       = 0x05 // DOS extended
	typeExtendedLBA    = 0x0f // W95 extended (LBA)
	typeLinuxExtended  = 0x85
	typeGPTProtective  = 0xee
	bootIndicatorBoot  = 0x80
	mbrSignature       = 0xaa55 // bytes 0x55 0xaa, little-endian
	mbrRecordsOffset   = 446
	mbrSignatureOffset = 510
)

// mbr is the Legacy MBR of UEFI §5.2.1, also the layout of an EBR. The boot
// code before UniqueMBRDiskSignature is not kept.
type mbr struct {
	UniqueMBRDiskSignature uint32    // offset 440
	Unknown                uint16    // offset 444
	PartitionRecord        [4]record // offset 446
	Signature              uint16    // offset 510: 0xAA55
}

// record is a Legacy MBR Partition Record (UEFI §5.2.1).
type record struct {
	BootIndicator uint8
	StartingCHS   [3]byte
	OSType        uint8
	EndingCHS     [3]byte
	StartingLBA   uint32
	SizeInLBA     uint32
}

func (r *record) extended() bool {
	return r.OSType == typeExtended || r.OSType == typeExtendedLBA || r.OSType == typeLinuxExtended
}

// decodeMBR decodes the 512 bytes of an MBR or EBR, without checking them.
func decodeMBR(b []byte) *mbr {
	var m mbr
	if _, err := binary.Decode(b[440:mbrSize], binary.LittleEndian, &m); err != nil {
		panic("partition: decoding an MBR: " + err.Error()) // b is 512 bytes: cannot happen
	}
	return &m
}

// parseMBR decodes LBA 0 and tells whether it is an MBR at all: it must end
// in 0x55 0xAA and, as the kernel requires (msdos_partition), every record's
// BootIndicator must be 0x00 or 0x80, which tells an MBR from the boot
// sector of a FAT or NTFS file system on the whole disk. Neither is a
// corruption: the disk just has no partition table.
func parseMBR(b []byte) (*mbr, error) {
	m := decodeMBR(b)
	if m.Signature != mbrSignature {
		return nil, fmt.Errorf("%w: no 0x55AA signature at byte %d", ErrNoTable, mbrSignatureOffset)
	}
	for i, r := range m.PartitionRecord {
		if r.BootIndicator != 0 && r.BootIndicator != bootIndicatorBoot {
			return nil, fmt.Errorf("%w: BootIndicator %#02x of MBR record %d at byte %d is neither 0x00 nor 0x80: a boot sector, not an MBR",
				ErrNoTable, r.BootIndicator, i+1, mbrRecordsOffset+16*i)
		}
	}
	return m, nil
}

// protective reports whether m is a protective (or hybrid) MBR: one of its
// records has OSType 0xEE (UEFI §5.2.3). The kernel also wants that
// record's StartingLBA to be 1; sfdisk does not, nor does Read.
func (m *mbr) protective() bool {
	for _, r := range m.PartitionRecord {
		if r.OSType == typeGPTProtective {
			return true
		}
	}
	return false
}

// empty reports whether no record of m is in use (a zero SizeInLBA is an
// unused record, whatever its type, as for the kernel).
func (m *mbr) empty() bool {
	for _, r := range m.PartitionRecord {
		if r.SizeInLBA != 0 {
			return false
		}
	}
	return true
}

// readMBR lists the primary partitions of m, then the logical partitions of
// each extended one, and checks them against the disk.
func (d *disk) readMBR(m *mbr) (*Table, error) {
	t := &Table{Scheme: "mbr", SectorSize: int(d.ss), DiskID: fmt.Sprintf("0x%08x", m.UniqueMBRDiskSignature)}
	var cands []candidate
	for i, r := range m.PartitionRecord {
		if r.SizeInLBA == 0 {
			continue
		}
		cands = append(cands, mbrCandidate(i+1, &r, uint64(r.StartingLBA)))
	}
	next, ebrs := 5, 0 // the next logical partition's number; EBRs read
	for i, r := range m.PartitionRecord {
		if r.SizeInLBA == 0 || !r.extended() {
			continue
		}
		logical, err := d.readEBRChain(t, i+1, uint64(r.StartingLBA), uint64(r.SizeInLBA), &next, &ebrs)
		if err != nil {
			return nil, err
		}
		cands = append(cands, logical...)
	}
	d.check(t, cands)
	return t, nil
}

func mbrCandidate(number int, r *record, first uint64) candidate {
	c := candidate{
		Partition: Partition{
			Number:   number,
			Type:     fmt.Sprintf("0x%02x", r.OSType),
			TypeName: mbrTypeNames[r.OSType],
			Bootable: r.BootIndicator == bootIndicatorBoot,
			Extended: r.extended(),
		},
		first: first,
		count: uint64(r.SizeInLBA),
	}
	return c
}

// readEBRChain follows the chain of EBRs of the extended partition number
// ext, which spans blocks [first, first+size), the way the kernel's
// parse_extended does, and returns its logical partitions, numbered from
// *next on. A broken chain (an EBR past the disk's end or without its
// signature, a loop, too many EBRs) ends it with a warning: the logical
// partitions found so far are kept. Only an I/O error is returned.
func (d *disk) readEBRChain(t *Table, ext int, first, size uint64, next, ebrs *int) ([]candidate, error) {
	var out []candidate
	seen := make(map[uint64]bool)
	this, thisSize := first, size // the current EBR and the extent its link gave
	for {
		if *next > MaxNumber {
			t.warnf("extended partition %d: logical partitions past number %d are ignored, as the kernel ignores them", ext, MaxNumber)
			return out, nil
		}
		if *ebrs >= MaxEBRs {
			t.warnf("extended partition %d: more than %d EBRs; the rest of the chain is ignored", ext, MaxEBRs)
			return out, nil
		}
		if seen[this] {
			t.warnf("extended partition %d: the EBR chain loops back to LBA %d; the rest of the chain is ignored", ext, this)
			return out, nil
		}
		seen[this] = true
		*ebrs++
		if this >= d.sectors {
			t.warnf("extended partition %d: EBR at LBA %d lies past the disk's last LBA %d; the rest of the chain is ignored", ext, this, d.lastLBA)
			return out, nil
		}
		b, err := d.read(fmt.Sprintf("EBR at LBA %d", this), int64(this)*d.ss, mbrSize)
		if err != nil {
			return nil, err
		}
		e := decodeMBR(b)
		if e.Signature != mbrSignature {
			t.warnf("extended partition %d: EBR at LBA %d has no 0x55AA signature; the rest of the chain is ignored", ext, this)
			return out, nil
		}

		// Data records first. The third and fourth sometimes hold
		// garbage, so, like the kernel, take them only when they lie
		// inside both the extent the link gave and the extended
		// partition.
		for i, r := range e.PartitionRecord {
			if r.SizeInLBA == 0 || r.extended() {
				continue
			}
			offs, n := uint64(r.StartingLBA), uint64(r.SizeInLBA)
			if i >= 2 && (offs+n > thisSize || this+offs+n > first+size) {
				continue
			}
			if *next > MaxNumber {
				break // warned about at the top of the loop
			}
			out = append(out, mbrCandidate(*next, &r, this+offs))
			*next++
		}

		// Then the first link, relative to the extended partition.
		link := -1
		for i, r := range e.PartitionRecord {
			if r.SizeInLBA != 0 && r.extended() {
				link = i
				break
			}
		}
		if link < 0 {
			return out, nil // the end of the chain
		}
		r := e.PartitionRecord[link]
		this, thisSize = first+uint64(r.StartingLBA), uint64(r.SizeInLBA)
	}
}
