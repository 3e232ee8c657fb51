package partition

import (
	"errors"
	"fmt"
	"io"
	"slices"
)

// Limits on what a disk can make Read do. A hostile disk can claim any
// number of GPT entries or link any number of EBRs; these bound the memory
// and the reads one call of Read costs.
const (
	// MaxEntryArray is the largest GPT partition entry array Read accepts,
	// in bytes (NumberOfPartitionEntries x SizeOfPartitionEntry). Tools
	// make 16 KiB (128 entries of 128 bytes); the kernel takes any size
	// it can kmalloc.
	MaxEntryArray = 1 << 20

	// MaxEBRs is the most extended boot records Read follows in all
	// extended partitions of a disk.
	MaxEBRs = 1024

	// MaxNumber is the highest partition number Read returns, as for
	// the Linux kernel, whose DISK_MAX_PARTS (256) leaves room for
	// numbers 1 to 255 and which ignores partitions past them.
	MaxNumber = 255
)

// Sentinel errors; test for them with errors.Is.
var (
	// ErrNoTable means the disk has no partition table: no MBR
	// signature, an MBR with no partition in it, or a boot sector that
	// is not an MBR (a file system on the whole disk).
	ErrNoTable = errors.New("partition: no partition table")

	// ErrCorrupt means the disk has a partition table but it cannot be
	// used: for GPT, neither the primary nor the backup header with its
	// entry array is valid. Every *FormatError wraps it.
	ErrCorrupt = errors.New("partition: corrupt partition table")
)

// A FormatError reports a malformed field: which structure and field (named
// as in the UEFI specification), the value found, the byte offset on the
// disk where it was read, and what is wrong with it. It wraps ErrCorrupt.
type FormatError struct {
	Struct string // e.g. "primary GPT header at LBA 1"
	Field  string // e.g. "HeaderCRC32"
	Value  uint64 // the offending value
	Offset int64  // byte offset of the field on the disk
	Msg    string
}

// Error says what is wrong, without the package prefix: Read returns a
// FormatError wrapped in an error that has it.
func (e *FormatError) Error() string {
	return fmt.Sprintf("%s %s = %#x at byte %d: %s", e.Struct, e.Field, e.Value, e.Offset, e.Msg)
}

func (e *FormatError) Unwrap() error { return ErrCorrupt }

// A Table is the partition table of a disk.
type Table struct {
	// Scheme is "gpt" or "mbr".
	Scheme string

	// SectorSize is the logical block size, in bytes, the table was read
	// with: LBAs in the table count blocks of this size.
	SectorSize int

	// DiskID is the GPT DiskGUID (canonical form), or the MBR's 32-bit
	// disk signature as "0x" and 8 hex digits (what sfdisk calls the
	// label id, and what blkid's PTUUID shows without the "0x").
	DiskID string

	// Partitions are the usable partitions, by increasing Number. Refused
	// partitions are not in it; Warnings say why.
	Partitions []Partition

	// Warnings are what a caller should log: partitions refused and why,
	// a damaged primary GPT replaced by its backup, a broken EBR chain.
	// Each is one line naming the partition number or structure.
	Warnings []string
}

// A Partition is one entry of a partition table, as a byte range of the
// disk.
type Partition struct {
	// Number is the kernel's partition number: the GPT entry index plus
	// one (unused entries leave gaps), the MBR record slot 1 to 4 for a
	// primary partition, or 5, 6, ... in chain order for a logical one.
	Number int

	// Start and Size are the partition's byte range on the disk. For a
	// returned partition, 0 < Start and Start+Size <= the disk's size.
	Start, Size int64

	// Type is the GPT PartitionTypeGUID in canonical form
	// ("0fc63daf-8483-4772-8e79-3d69d8477de4"), or the MBR OSType byte
	// as "0x" and two hex digits ("0x83").
	Type string

	// TypeName is a name for a few well-known types ("Linux filesystem",
	// "EFI System", "Linux swap", ...), as fdisk prints them, or "".
	TypeName string

	// Name is the GPT PartitionName, decoded from UTF-16LE. MBR: "".
	Name string

	// GUID is the GPT UniquePartitionGUID in canonical form (the kernel's
	// PARTUUID). MBR: "".
	GUID string

	// Attributes are the GPT attribute bits (bit 0 required partition,
	// bit 2 legacy BIOS bootable, 48-63 type specific). MBR: 0.
	Attributes uint64

	// Bootable is the MBR BootIndicator 0x80. GPT: false.
	Bootable bool

	// Extended marks an MBR extended partition: a container of logical
	// partitions, not a volume. Start and Size span the whole container.
	Extended bool
}

// Read reads the partition table of the disk r of size bytes.
//
// sectorSize is the disk's logical block size: 512, or 4096 for a
// "4Kn" disk, or any power of two from 512 to 65536. 0 means detect it: a
// GPT is looked for with 512- and 4096-byte blocks (the header's position
// gives the size away); an MBR does not record its block size and is read
// with 512.
//
// A disk without a partition table is an error wrapping ErrNoTable; a table
// that cannot be used at all is one wrapping ErrCorrupt; an error reading r
// is returned wrapped, as is. Problems that leave the rest of the table
// usable (one bad partition, a damaged primary GPT with a good backup) are
// Table.Warnings instead.
//
// Read keeps no state: any number of calls may run at once on one r, if
// r's ReadAt allows that, as io.ReaderAt's contract says it must.
func Read(r io.ReaderAt, size int64, sectorSize int) (*Table, error) {
	if sectorSize != 0 && (sectorSize < 512 || sectorSize > 65536 || sectorSize&(sectorSize-1) != 0) {
		return nil, fmt.Errorf("partition: sector size %d: not a power of two from 512 to 65536", sectorSize)
	}
	if size < 0 {
		return nil, fmt.Errorf("partition: disk size %d is negative", size)
	}
	d := &disk{r: r, size: size}
	if size < mbrSize {
		return nil, fmt.Errorf("%w: the disk is %d bytes, less than one sector", ErrNoTable, size)
	}
	b, err := d.read("MBR", 0, mbrSize)
	if err != nil {
		return nil, err
	}
	m, err := parseMBR(b)
	if err == nil && m.protective() {
		if sectorSize == 0 {
			sectorSize = d.detectGPTSectorSize()
		}
		d.setSectorSize(sectorSize)
		return d.readGPT()
	}
	if sectorSize == 0 {
		sectorSize = 512
	}
	d.setSectorSize(sectorSize)
	if err == nil && m.empty() {
		err = fmt.Errorf("%w: an MBR signature but no partition in it (a FAT or NTFS file system on the whole disk, or an empty table)", ErrNoTable)
	}
	if err != nil {
		// Say so when a GPT is there but, without its protective MBR,
		// not taken for one: the kernel, sfdisk and blkid ignore it too.
		if errors.Is(err, ErrNoTable) && d.hasGPTSignature(1) {
			err = fmt.Errorf("%w; a GPT header at LBA 1 is ignored: no protective MBR", err)
		}
		return nil, err
	}
	return d.readMBR(m)
}

// A disk is the device Read reads, with the block size it settled on.
type disk struct {
	r       io.ReaderAt
	size    int64
	ss      int64  // logical block size in bytes
	sectors uint64 // whole blocks on the disk
	lastLBA uint64 // sectors-1; only meaningful when sectors > 0
}

func (d *disk) setSectorSize(ss int) {
	d.ss = int64(ss)
	d.sectors = uint64(d.size / d.ss)
	d.lastLBA = d.sectors - 1
}

// read reads n bytes at byte offset off, which the caller has checked lie
// inside the disk. what names the structure for the error message.
func (d *disk) read(what string, off int64, n int) ([]byte, error) {
	if off < 0 || int64(n) > d.size-off {
		return nil, fmt.Errorf("partition: reading %s: bytes %d-%d lie past the disk's end (%d bytes)", what, off, off+int64(n)-1, d.size)
	}
	b := make([]byte, n)
	got, err := d.r.ReadAt(b, off)
	if got == n {
		return b, nil // an io.EOF with a full read is not an error
	}
	if err == nil || err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	return nil, fmt.Errorf("partition: reading %s at byte %d: %w", what, off, err)
}

// A candidate is a partition as the table describes it, in blocks, before
// it is checked against the disk and the other partitions.
type candidate struct {
	Partition
	first, count uint64 // first block and number of blocks
}

// check turns candidates into the table's partitions: a candidate that
// starts at LBA 0 or runs past the disk's end is refused, and so is every
// partition that overlaps another (extended containers excepted); each
// refusal is a warning. The partitions returned are sorted by number.
func (d *disk) check(t *Table, cands []candidate) {
	var ok []candidate
	for _, c := range cands {
		switch last := c.first + c.count - 1; {
		case c.first == 0:
			t.warnf("partition %d refused: it starts at LBA 0, over the partition table", c.Number)
		case c.first >= d.sectors || c.count > d.sectors-c.first:
			t.warnf("partition %d refused: LBA %d-%d runs past the disk's last LBA %d", c.Number, c.first, last, d.lastLBA)
		default:
			c.Start, c.Size = int64(c.first)*d.ss, int64(c.count)*d.ss
			ok = append(ok, c)
		}
	}

	// Sweep the volumes by start, remembering the one reaching furthest:
	// any volume starting before that reach overlaps it. A volume that
	// overlaps another is marked when either of them is met, so every
	// volume in an overlapping pair is refused, not just the later one:
	// nothing tells which of the two the table meant.
	var vols []int // indexes in ok
	for i := range ok {
		if !ok[i].Extended {
			vols = append(vols, i)
		}
	}
	slices.SortStableFunc(vols, func(a, b int) int {
		if ok[a].first != ok[b].first {
			if ok[a].first < ok[b].first {
				return -1
			}
			return 1
		}
		return ok[a].Number - ok[b].Number
	})
	overlaps := make(map[int]int) // index in ok -> index of a volume it overlaps
	reach := -1                   // index in ok of the volume ending last so far
	for _, i := range vols {
		if reach >= 0 && ok[i].first <= ok[reach].first+ok[reach].count-1 {
			overlaps[i] = reach
			if _, seen := overlaps[reach]; !seen {
				overlaps[reach] = i
			}
		}
		if reach < 0 || ok[i].first+ok[i].count > ok[reach].first+ok[reach].count {
			reach = i
		}
	}
	for i, c := range ok {
		if j, bad := overlaps[i]; bad {
			o := ok[j]
			t.warnf("partition %d refused: LBA %d-%d overlaps partition %d (LBA %d-%d)",
				c.Number, c.first, c.first+c.count-1, o.Number, o.first, o.first+o.count-1)
			continue
		}
		t.Partitions = append(t.Partitions, c.Partition)
	}
	slices.SortStableFunc(t.Partitions, func(a, b Partition) int { return a.Number - b.Number })
}

func (t *Table) warnf(format string, args ...any) {
	t.Warnings = append(t.Warnings, fmt.Sprintf(format, args...))
}
