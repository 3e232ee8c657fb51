package partition

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"hash/crc32"
	"unicode/utf16"
)

const (
	gptSignature      = "EFI PART"
	gptRevisionMajor  = 1  // Revision 1.0 is 0x00010000; minor versions are accepted
	gptHeaderMinSize  = 92 // the size of the fields below
	gptEntryMinSize   = 128
	gptEntryNameChars = 36
)

// gptHeader is the GPT Header of UEFI §5.3.2, field by field.
type gptHeader struct {
	Signature                [8]byte
	Revision                 uint32
	HeaderSize               uint32
	HeaderCRC32              uint32
	Reserved                 uint32
	MyLBA                    uint64
	AlternateLBA             uint64
	FirstUsableLBA           uint64
	LastUsableLBA            uint64
	DiskGUID                 [16]byte
	PartitionEntryLBA        uint64
	NumberOfPartitionEntries uint32
	SizeOfPartitionEntry     uint32
	PartitionEntryArrayCRC32 uint32
}

// Byte offsets of the header fields that error messages point at.
const (
	offRevision                 = 8
	offHeaderSize               = 12
	offHeaderCRC32              = 16
	offMyLBA                    = 24
	offFirstUsableLBA           = 40
	offLastUsableLBA            = 48
	offPartitionEntryLBA        = 72
	offNumberOfPartitionEntries = 80
	offSizeOfPartitionEntry     = 84
	offPartitionEntryArrayCRC32 = 88
)

// gptEntry is a GPT Partition Entry of UEFI §5.3.3, the first 128 bytes of
// an entry of SizeOfPartitionEntry bytes.
type gptEntry struct {
	PartitionTypeGUID   [16]byte
	UniquePartitionGUID [16]byte
	StartingLBA         uint64
	EndingLBA           uint64 // inclusive
	Attributes          uint64
	PartitionName       [gptEntryNameChars]uint16
}

// A gpt is a header and its entry array, both checked.
type gpt struct {
	hdr     gptHeader
	entries []byte // NumberOfPartitionEntries x SizeOfPartitionEntry bytes
}

// hasGPTSignature reports whether block lba starts with "EFI PART".
func (d *disk) hasGPTSignature(lba uint64) bool {
	if lba >= d.sectors {
		return false
	}
	b, err := d.read("GPT signature", int64(lba)*d.ss, len(gptSignature))
	return err == nil && string(b) == gptSignature
}

// detectGPTSectorSize finds the block size of a disk with a protective MBR:
// the size at which LBA 1, or else the last LBA, holds a GPT signature.
// 512 if none does; Read then reports the GPT as corrupt.
func (d *disk) detectGPTSectorSize() int {
	sizes := []int{512, 4096}
	for _, ss := range sizes {
		if d.setSectorSize(ss); d.hasGPTSignature(1) {
			return ss
		}
	}
	for _, ss := range sizes {
		if d.setSectorSize(ss); d.sectors > 0 && d.hasGPTSignature(d.lastLBA) {
			return ss
		}
	}
	return 512
}

// readGPT reads the GPT of a disk with a protective MBR: the primary header
// at LBA 1 if it and its array are valid, else the backup, as UEFI §5.3.2
// says, with a warning. With neither valid, the error wraps ErrCorrupt and
// tells what is wrong with both.
func (d *disk) readGPT() (*Table, error) {
	t := &Table{Scheme: "gpt", SectorSize: int(d.ss)}
	if d.sectors < 3 {
		return nil, fmt.Errorf("partition: %w", &FormatError{Struct: "disk", Field: "size", Value: uint64(d.size), Offset: 0,
			Msg: fmt.Sprintf("a protective MBR, but the disk is too small for a GPT with %d-byte blocks", d.ss)})
	}
	primary, hdr, perr := d.readGPTAt("primary GPT header", 1)
	if perr != nil && !isFormatError(perr) {
		return nil, perr
	}
	if perr == nil {
		d.checkBackup(t, primary)
		return d.gptTable(t, primary), nil
	}

	// The backup belongs at the last LBA. A primary header whose array
	// alone is bad still says where its backup is, which differs when
	// the disk grew after partitioning (qemu-img resize): try there too.
	lbas := []uint64{d.lastLBA}
	if hdr != nil && hdr.AlternateLBA != d.lastLBA && hdr.AlternateLBA > 1 && hdr.AlternateLBA < d.sectors {
		lbas = append(lbas, hdr.AlternateLBA)
	}
	var berr error
	for _, lba := range lbas {
		var backup *gpt
		backup, _, berr = d.readGPTAt("backup GPT header", lba)
		if berr != nil && !isFormatError(berr) {
			return nil, berr
		}
		if berr == nil {
			t.warnf("the primary GPT is invalid, the backup at LBA %d is used: %v", lba, perr)
			return d.gptTable(t, backup), nil
		}
	}
	err := fmt.Errorf("partition: no valid GPT: %w; and %w", perr, berr)
	if other := d.otherSectorSize(); other != 0 {
		err = fmt.Errorf("%w (a GPT header is at LBA 1 of %d-byte blocks: is that the disk's sector size?)", err, other)
	}
	return nil, err
}

// otherSectorSize returns the block size, 512 or 4096 but not the one in
// use, at which LBA 1 holds a GPT signature, or 0.
func (d *disk) otherSectorSize() int {
	other := 4096
	if d.ss == 4096 {
		other = 512
	}
	if d.ss != 512 && d.ss != 4096 || int64(2*other) > d.size {
		return 0
	}
	b, err := d.read("GPT signature", int64(other), len(gptSignature))
	if err != nil || string(b) != gptSignature {
		return 0
	}
	return other
}

// checkBackup warns when a valid primary GPT's backup is missing, damaged,
// misplaced or different, as the kernel's compare_gpts does: nothing is
// lost yet, but a second failure would be fatal.
func (d *disk) checkBackup(t *Table, primary *gpt) {
	alt := primary.hdr.AlternateLBA
	if alt != d.lastLBA {
		t.warnf("the primary GPT header's AlternateLBA %d is not the disk's last LBA %d (was the disk resized?)", alt, d.lastLBA)
	}
	if alt <= 1 || alt >= d.sectors {
		return
	}
	backup, _, err := d.readGPTAt("backup GPT header", alt)
	switch {
	case err != nil:
		t.warnf("the backup GPT is invalid, the primary is used: %v", err)
	case backup.hdr.PartitionEntryArrayCRC32 != primary.hdr.PartitionEntryArrayCRC32 ||
		backup.hdr.FirstUsableLBA != primary.hdr.FirstUsableLBA ||
		backup.hdr.LastUsableLBA != primary.hdr.LastUsableLBA:
		t.warnf("the backup GPT at LBA %d differs from the primary, the primary is used", alt)
	}
}

// readGPTAt reads and checks the GPT header at block lba and its entry
// array. what names the header in errors. When the header itself is valid
// but its array is not, the header is returned with the error, so that its
// AlternateLBA can still be used.
func (d *disk) readGPTAt(what string, lba uint64) (*gpt, *gptHeader, error) {
	base := int64(lba) * d.ss // lba < d.sectors: checked by the callers
	b, err := d.read(what, base, int(d.ss))
	if err != nil {
		return nil, nil, err
	}
	bad := func(field string, off int64, v uint64, format string, args ...any) error {
		return &FormatError{Struct: fmt.Sprintf("%s at LBA %d", what, lba), Field: field, Value: v,
			Offset: base + off, Msg: fmt.Sprintf(format, args...)}
	}

	var h gptHeader
	if _, err := binary.Decode(b, binary.LittleEndian, &h); err != nil {
		panic("partition: decoding a GPT header: " + err.Error()) // b holds >= 512 bytes: cannot happen
	}
	if string(h.Signature[:]) != gptSignature {
		return nil, nil, bad("Signature", 0, binary.LittleEndian.Uint64(h.Signature[:]), "not %q", gptSignature)
	}
	if h.Revision>>16 != gptRevisionMajor {
		return nil, nil, bad("Revision", offRevision, uint64(h.Revision), "not version 1.x")
	}
	if h.HeaderSize < gptHeaderMinSize || int64(h.HeaderSize) > d.ss {
		return nil, nil, bad("HeaderSize", offHeaderSize, uint64(h.HeaderSize), "not between %d and the block size %d", gptHeaderMinSize, d.ss)
	}
	sum := make([]byte, h.HeaderSize)
	copy(sum, b)
	clear(sum[offHeaderCRC32 : offHeaderCRC32+4])
	if c := crc32.ChecksumIEEE(sum); c != h.HeaderCRC32 {
		return nil, nil, bad("HeaderCRC32", offHeaderCRC32, uint64(h.HeaderCRC32), "the header's CRC32 is %#08x", c)
	}
	if h.MyLBA != lba {
		return nil, nil, bad("MyLBA", offMyLBA, h.MyLBA, "the header was read from LBA %d", lba)
	}
	if h.FirstUsableLBA > h.LastUsableLBA {
		return nil, nil, bad("FirstUsableLBA", offFirstUsableLBA, h.FirstUsableLBA, "past LastUsableLBA %d", h.LastUsableLBA)
	}
	if h.LastUsableLBA > d.lastLBA {
		return nil, nil, bad("LastUsableLBA", offLastUsableLBA, h.LastUsableLBA, "past the disk's last LBA %d (was the disk shrunk?)", d.lastLBA)
	}
	if h.SizeOfPartitionEntry < gptEntryMinSize || h.SizeOfPartitionEntry%8 != 0 {
		return nil, nil, bad("SizeOfPartitionEntry", offSizeOfPartitionEntry, uint64(h.SizeOfPartitionEntry), "not a multiple of 8 of at least %d", gptEntryMinSize)
	}
	arraySize := uint64(h.NumberOfPartitionEntries) * uint64(h.SizeOfPartitionEntry)
	if arraySize > MaxEntryArray {
		return nil, nil, bad("NumberOfPartitionEntries", offNumberOfPartitionEntries, uint64(h.NumberOfPartitionEntries),
			"%d entries of %d bytes are more than the %d bytes this package reads", h.NumberOfPartitionEntries, h.SizeOfPartitionEntry, MaxEntryArray)
	}
	blocks := (arraySize + uint64(d.ss) - 1) / uint64(d.ss)
	if arraySize > 0 {
		pel := h.PartitionEntryLBA
		switch {
		case pel == 0:
			return nil, nil, bad("PartitionEntryLBA", offPartitionEntryLBA, pel, "the entry array would overwrite the MBR")
		case pel >= d.sectors || blocks > d.sectors-pel:
			return nil, nil, bad("PartitionEntryLBA", offPartitionEntryLBA, pel, "the entry array (%d blocks) runs past the disk's last LBA %d", blocks, d.lastLBA)
		case pel <= lba && lba < pel+blocks:
			return nil, nil, bad("PartitionEntryLBA", offPartitionEntryLBA, pel, "the entry array (%d blocks) would overwrite the header", blocks)
		}
	}

	// The header is sound; now its array.
	entries, err := d.read(fmt.Sprintf("GPT entry array of the %s at LBA %d", what, lba), int64(h.PartitionEntryLBA)*d.ss, int(arraySize))
	if err != nil {
		return nil, nil, err
	}
	if c := crc32.ChecksumIEEE(entries); c != h.PartitionEntryArrayCRC32 {
		return nil, &h, bad("PartitionEntryArrayCRC32", offPartitionEntryArrayCRC32, uint64(h.PartitionEntryArrayCRC32),
			"the CRC32 of the entry array at LBA %d is %#08x", h.PartitionEntryLBA, c)
	}
	return &gpt{hdr: h, entries: entries}, &h, nil
}

// gptTable lists the used entries of g as partitions and checks them.
func (d *disk) gptTable(t *Table, g *gpt) *Table {
	t.DiskID = guidString(g.hdr.DiskGUID)
	var cands []candidate
	esz := int(g.hdr.SizeOfPartitionEntry)
	for i := 0; i < int(g.hdr.NumberOfPartitionEntries); i++ {
		raw := g.entries[i*esz : (i+1)*esz]
		if [16]byte(raw) == [16]byte{} {
			continue // an unused entry: its PartitionTypeGUID is all zeros
		}
		var e gptEntry
		if _, err := binary.Decode(raw, binary.LittleEndian, &e); err != nil {
			panic("partition: decoding a GPT entry: " + err.Error()) // esz >= 128: cannot happen
		}
		n := i + 1
		if n > MaxNumber {
			t.warnf("GPT entries past number %d are ignored, as the kernel ignores them", MaxNumber)
			break
		}
		switch {
		case e.EndingLBA < e.StartingLBA:
			t.warnf("partition %d refused: EndingLBA %d is before StartingLBA %d", n, e.EndingLBA, e.StartingLBA)
			continue
		case e.StartingLBA < g.hdr.FirstUsableLBA:
			t.warnf("partition %d refused: StartingLBA %d is before the GPT's FirstUsableLBA %d", n, e.StartingLBA, g.hdr.FirstUsableLBA)
			continue
		case e.EndingLBA > g.hdr.LastUsableLBA:
			t.warnf("partition %d refused: EndingLBA %d is past the GPT's LastUsableLBA %d", n, e.EndingLBA, g.hdr.LastUsableLBA)
			continue
		}
		typ := guidString(e.PartitionTypeGUID)
		cands = append(cands, candidate{
			Partition: Partition{
				Number:     n,
				Type:       typ,
				TypeName:   gptTypeNames[typ],
				Name:       decodeName(e.PartitionName[:]),
				GUID:       guidString(e.UniquePartitionGUID),
				Attributes: e.Attributes,
			},
			first: e.StartingLBA,
			count: e.EndingLBA - e.StartingLBA + 1, // LastUsableLBA <= lastLBA: no overflow
		})
	}
	d.check(t, cands)
	return t
}

// guidString formats a GUID as stored on disk (UEFI Appendix A: the first
// three fields little-endian, the last two big-endian) in the canonical
// form of RFC 4122, lower case.
func guidString(g [16]byte) string {
	var be [16]byte
	be[0], be[1], be[2], be[3] = g[3], g[2], g[1], g[0]
	be[4], be[5] = g[5], g[4]
	be[6], be[7] = g[7], g[6]
	copy(be[8:], g[8:])
	h := hex.EncodeToString(be[:])
	return h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

// decodeName decodes a PartitionName: UTF-16LE up to the first NUL.
// Unpaired surrogates become U+FFFD.
func decodeName(name []uint16) string {
	for i, c := range name {
		if c == 0 {
			name = name[:i]
			break
		}
	}
	return string(utf16.Decode(name))
}

func isFormatError(err error) bool {
	_, ok := err.(*FormatError)
	return ok
}
