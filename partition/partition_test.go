package partition

import (
	"bytes"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"strings"
	"testing"
)

// A diskCase is a disk made with util-linux, maybe damaged, and what Read
// must make of it.
type diskCase struct {
	name       string
	size       string                               // the disk's size (truncate -s)
	sectorSize int                                  // its logical block size
	build      func(testing.TB, string)             // partitions (and patches) the disk; the oracle reads the result
	oracle     func(testing.TB, string, int) oracle // nil: sfdisk --json (512-byte blocks)
	damage     func(testing.TB, string)             // applied after the oracle: what Read returns must not change
	refused    map[int]string                       // partitions the oracle lists that Read must refuse -> warning text
	warnings   []string                             // other warnings Read must give (substrings)
	noDetect   bool                                 // detection (sectorSize 0) finds another answer: skip it
	wantErr    error                                // ErrNoTable or ErrCorrupt: no table returned
	errText    string                               // a substring of the error
}

// Scripts for sfdisk.
const (
	// gptScript makes seven partitions of assorted types, names and
	// attributes; gptDisk deletes the second, leaving a gap.
	gptScript = `label: gpt
size=2M, type=L, name="root fs", attrs="RequiredPartition,GUID:60,63"
size=3M, type=S, name=swap
size=1M, type=U, name="EFI System Partition", attrs="LegacyBIOSBootable"
size=1M, type=21686148-6449-6E6F-744E-656564454649, name="bios_grub"
size=2M, type=E3C9E316-0B5C-4DB8-817D-F92DF00215AE, name="abéz Ω"
size=2M, type=EBD0A0A2-B9E5-4433-87C0-68B6B72699C7, name="123456789012345678901234567890123456"
size=2M, type=E6D6D379-F507-44C2-A23C-238F2A3DF928
`
	// tinyGPTScript packs a GPT with a 4-entry array and three
	// partitions into 64 KiB, so the whole disk can seed the fuzzer.
	tinyGPTScript = `label: gpt
table-length: 4
first-lba: 3
start=4, size=20, name="a"
start=24, size=30, type=S
start=60, size=40, name="c"
`
	// mbrScript makes four primary partitions, the third extended with
	// three logical partitions in it.
	mbrScript = `label: dos
size=2M, type=83, bootable
size=3M, type=82
size=20M, type=5
size=4M, type=83
size=2M, type=7
size=3M, type=8e
size=4M, type=83
`
	// tinyMBRScript packs primaries, an extended partition and three
	// logicals into 64 KiB, so the whole disk can seed the fuzzer.
	tinyMBRScript = `label: dos
start=4, size=8, type=83
start=12, size=100, type=5
start=112, size=4, type=83
start=14, size=8, type=7
start=24, size=8, type=83
start=34, size=6
`
	// fourPrimaries makes four primaries at 1-3M, 3-5M, 8-12M, 14-16M.
	fourPrimaries = `label: dos
start=1M, size=2M, type=83
start=3M, size=2M, type=83
start=8M, size=4M, type=83
start=14M, size=2M, type=83
`
)

// manyGPTPartitions is a script for n partitions of two sectors each.
func manyGPTPartitions(n int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "label: gpt\ntable-length: %d\nfirst-lba: 100\n", n)
	for i := range n {
		fmt.Fprintf(&b, "start=%d, size=2, name=\"p%d\"\n", 100+4*i, i+1)
	}
	return b.String()
}

// Commands for fdisk -b 4096. GPT: partitions 1 (named), 2 (swap) and 3,
// then 2 is deleted. MBR: a bootable primary, an extended partition with
// two logicals.
const (
	gpt4096Commands = "g\nn\n1\n\n+2M\nn\n2\n\n+3M\nt\n2\nswap\nn\n3\n\n+1M\nx\nn\n1\nroot fs\nr\nd\n2\nw\n"
	mbr4096Commands = "o\nn\np\n1\n\n+2M\na\nn\ne\n2\n\n+10M\nn\nl\n\n+1M\nn\nl\n\n+2M\nw\n"
)

var zeroSector = make([]byte, 512)

// patchGPTHeader returns a step writing b at byte off of the primary GPT
// header (512-byte blocks) and recomputing its HeaderCRC32, so that the
// header is damaged only in the field written.
func patchGPTHeader(off int64, b []byte) func(testing.TB, string) {
	return func(t testing.TB, path string) {
		t.Helper()
		disk, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		copy(disk[512+off:], b)
		h := disk[512:1024]
		copy(h[16:20], le32(0))
		size := int(h[12]) | int(h[13])<<8
		copy(h[16:20], le32(crc32.ChecksumIEEE(h[:size])))
		if err := os.WriteFile(path, disk, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

var diskCases = []diskCase{
	// GPT.
	{name: "gpt", size: "40M", sectorSize: 512, build: steps(sfdisk(gptScript), deletePartition(2))},
	{name: "gpt empty", size: "10M", sectorSize: 512, build: sfdisk("label: gpt\n")},
	{name: "gpt tiny", size: "64K", sectorSize: 512, build: sfdisk(tinyGPTScript)},
	{
		// 260 partitions: numbers past 255 are dropped, as by the kernel.
		name: "gpt 260 partitions", size: "2M", sectorSize: 512, build: sfdisk(manyGPTPartitions(260)),
		warnings: []string{"GPT entries past number 255 are ignored, as the kernel ignores them"},
	},
	{name: "gpt 4096", size: "40M", sectorSize: 4096, build: fdisk4096(gpt4096Commands), oracle: partxOracle},
	{
		// Read with the wrong sector size, a GPT is unusable (detection
		// finds the right one: see "gpt 4096").
		name: "gpt 4096 read as 512", size: "40M", sectorSize: 512, build: fdisk4096(gpt4096Commands), noDetect: true,
		wantErr: ErrCorrupt,
		errText: "(a GPT header is at LBA 1 of 4096-byte blocks: is that the disk's sector size?)",
	},
	{
		name: "gpt primary header zeroed", size: "40M", sectorSize: 512, build: sfdisk(gptScript),
		damage:   writeAt(512, zeroSector),
		warnings: []string{"the primary GPT is invalid, the backup at LBA 81919 is used: primary GPT header at LBA 1 Signature = 0x0 at byte 512"},
	},
	{
		name: "gpt primary header CRC", size: "40M", sectorSize: 512, build: sfdisk(gptScript),
		damage:   flipByte(512 + 56), // a byte of DiskGUID
		warnings: []string{"the primary GPT is invalid, the backup at LBA 81919 is used", "HeaderCRC32", "at byte 528"},
	},
	{
		name: "gpt primary entry array CRC", size: "40M", sectorSize: 512, build: sfdisk(gptScript),
		damage:   flipByte(1024 + 56), // the first letter of entry 1's name
		warnings: []string{"the primary GPT is invalid, the backup at LBA 81919 is used", "PartitionEntryArrayCRC32", "at byte 600"},
	},
	{
		name: "gpt primary entry size", size: "40M", sectorSize: 512, build: sfdisk(gptScript),
		damage:   patchGPTHeader(84, le32(100)),
		warnings: []string{"backup at LBA 81919 is used", "SizeOfPartitionEntry = 0x64 at byte 596"},
	},
	{
		name: "gpt primary too many entries", size: "40M", sectorSize: 512, build: sfdisk(gptScript),
		damage:   patchGPTHeader(80, le32(1<<20)),
		warnings: []string{"backup at LBA 81919 is used", "NumberOfPartitionEntries = 0x100000", "more than the 1048576 bytes"},
	},
	{
		name: "gpt primary MyLBA", size: "40M", sectorSize: 512, build: sfdisk(gptScript),
		damage:   patchGPTHeader(24, le64(2)),
		warnings: []string{"backup at LBA 81919 is used", "MyLBA = 0x2", "read from LBA 1"},
	},
	{
		name: "gpt backup zeroed", size: "40M", sectorSize: 512, build: sfdisk(gptScript),
		damage:   writeAt(-512, zeroSector),
		warnings: []string{"the backup GPT is invalid, the primary is used: backup GPT header at LBA 81919 Signature"},
	},
	{
		name: "gpt both headers zeroed", size: "40M", sectorSize: 512, build: sfdisk(gptScript),
		damage:  steps(writeAt(512, zeroSector), writeAt(-512, zeroSector)),
		wantErr: ErrCorrupt,
		errText: "partition: no valid GPT: primary GPT header at LBA 1 Signature = 0x0 at byte 512: not \"EFI PART\"; and backup GPT header at LBA 81919 Signature",
	},
	{
		name: "gpt primary zeroed backup array CRC", size: "40M", sectorSize: 512, build: sfdisk(gptScript),
		damage:  steps(writeAt(512, zeroSector), flipByte(-33*512)), // the backup array's first byte
		wantErr: ErrCorrupt,
		errText: "backup GPT header at LBA 81919 PartitionEntryArrayCRC32",
	},
	{
		name: "gpt disk grown", size: "40M", sectorSize: 512, build: sfdisk(gptScript),
		damage:   truncateTo("50M"),
		warnings: []string{"AlternateLBA 81919 is not the disk's last LBA 102399 (was the disk resized?)"},
	},
	{
		// The primary header is fine, its array is not: the backup is
		// found where the header says, not at the (new) last LBA.
		name: "gpt disk grown primary array CRC", size: "40M", sectorSize: 512, build: sfdisk(gptScript),
		damage:   steps(truncateTo("50M"), flipByte(1024+56)),
		warnings: []string{"the primary GPT is invalid, the backup at LBA 81919 is used", "PartitionEntryArrayCRC32"},
	},
	{
		name: "gpt disk shrunk", size: "40M", sectorSize: 512, build: sfdisk(gptScript),
		damage:  truncateTo("30M"),
		wantErr: ErrCorrupt,
		errText: "LastUsableLBA = 0x13fde at byte 560: past the disk's last LBA 61439 (was the disk shrunk?)",
	},
	{
		// Entries patched in the primary GPT, CRCs recomputed: sfdisk
		// lists them; Read refuses them.
		name: "gpt bad partitions", size: "40M", sectorSize: 512,
		build: steps(sfdisk(gptScript),
			patchGPTEntry(2, entStartingLBA, le64(5000)),                                         // into partition 1 (2048-6143)
			patchGPTEntry(3, entStartingLBA, le64(10)), patchGPTEntry(3, entEndingLBA, le64(20)), // before FirstUsableLBA 2048
			patchGPTEntry(4, entEndingLBA, le64(81900)), // past LastUsableLBA 81886
		),
		refused: map[int]string{
			1: "LBA 2048-6143 overlaps partition 2 (LBA 5000-12287)",
			2: "LBA 5000-12287 overlaps partition 1 (LBA 2048-6143)",
			3: "StartingLBA 10 is before the GPT's FirstUsableLBA 2048",
			4: "EndingLBA 81900 is past the GPT's LastUsableLBA 81886",
		},
		warnings: []string{"the backup GPT at LBA 81919 differs from the primary, the primary is used"},
	},
	{
		name: "gpt without protective MBR", size: "40M", sectorSize: 512, build: sfdisk(gptScript),
		damage:  writeAt(0, zeroSector),
		wantErr: ErrNoTable,
		errText: "no 0x55AA signature at byte 510; a GPT header at LBA 1 is ignored: no protective MBR",
	},

	// MBR.
	{name: "mbr", size: "60M", sectorSize: 512, build: sfdisk(mbrScript)},
	{name: "mbr tiny", size: "64K", sectorSize: 512, build: sfdisk(tinyMBRScript)},
	{name: "mbr logical deleted", size: "60M", sectorSize: 512, build: steps(sfdisk(mbrScript), deletePartition(6))},
	{name: "mbr primary gap", size: "20M", sectorSize: 512, build: steps(sfdisk(fourPrimaries), deletePartition(2))},
	{name: "mbr extended 0x0f", size: "20M", sectorSize: 512, build: sfdisk("label: dos\nsize=2M\nsize=10M, type=f\nsize=2M\nsize=3M, type=c\n")},
	{name: "mbr extended 0x85", size: "20M", sectorSize: 512, build: sfdisk("label: dos\nsize=10M, type=85\nsize=2M, type=82\nsize=3M\n")},
	{
		// An MBR does not record its sector size: detection assumes 512.
		name: "mbr 4096", size: "40M", sectorSize: 4096, build: fdisk4096(mbr4096Commands), oracle: partxOracle,
		noDetect: true,
	},
	{
		name: "mbr past end", size: "20M", sectorSize: 512,
		build: steps(sfdisk(fourPrimaries), truncateTo("9M")),
		refused: map[int]string{
			3: "LBA 16384-24575 runs past the disk's last LBA 18431",
			4: "LBA 28672-32767 runs past the disk's last LBA 18431",
		},
	},
	{
		name: "mbr size patched", size: "20M", sectorSize: 512,
		build:   steps(sfdisk(fourPrimaries), writeAt(mbrRecord(0, 2, recSizeInLBA), le32(0xffffffff))),
		refused: map[int]string{2: "LBA 6144-4294973438 runs past the disk's last LBA 40959"},
	},
	{
		name: "mbr overlap", size: "20M", sectorSize: 512,
		build: steps(sfdisk(fourPrimaries), writeAt(mbrRecord(0, 2, recStartingLBA), le32(4000))),
		refused: map[int]string{
			1: "LBA 2048-6143 overlaps partition 2 (LBA 4000-8095)",
			2: "LBA 4000-8095 overlaps partition 1 (LBA 2048-6143)",
		},
	},
	{
		// A primary grown over a logical partition: both refused; the
		// extended partition holding the logical is not a volume and
		// stays.
		name: "mbr primary over logical", size: "60M", sectorSize: 512,
		build: steps(sfdisk(mbrScript), writeAt(mbrRecord(0, 2, recSizeInLBA), le32(6<<11))),
		refused: map[int]string{
			2: "LBA 6144-18431 overlaps partition 5 (LBA 14336-18431)",
			5: "LBA 14336-18431 overlaps partition 2 (LBA 6144-18431)",
		},
	},
	{
		name: "mbr starts at 0", size: "20M", sectorSize: 512,
		build:   steps(sfdisk(fourPrimaries), writeAt(mbrRecord(0, 1, recStartingLBA), le32(0))),
		refused: map[int]string{1: "it starts at LBA 0"},
	},
	{
		// The last EBR links back to the first: the chain is cut there,
		// every logical partition listed once.
		name: "mbr EBR loop", size: "64K", sectorSize: 512, build: sfdisk(tinyMBRScript),
		damage: steps(
			patchEBR(-1, 2, recOSType, []byte{0x05}),
			patchEBR(-1, 2, recStartingLBA, le32(0)),
			patchEBR(-1, 2, recSizeInLBA, le32(10)),
		),
		warnings: []string{"extended partition 2: the EBR chain loops back to LBA 12; the rest of the chain is ignored"},
	},
	{
		// The chain ends at the second EBR, as for the kernel and
		// libblkid (partx, the oracle here); libfdisk reads on.
		name: "mbr EBR without signature", size: "64K", sectorSize: 512, oracle: partxOracle,
		build:    steps(sfdisk(tinyMBRScript), func(t testing.TB, p string) { writeAt(ebrLBAs(t, p)[1]*512+510, []byte{0, 0})(t, p) }),
		warnings: []string{"extended partition 2: EBR at LBA 23 has no 0x55AA signature; the rest of the chain is ignored"},
	},
	{
		name: "mbr EBR past end", size: "64K", sectorSize: 512,
		build:    steps(sfdisk(tinyMBRScript), patchEBR(0, 2, recStartingLBA, le32(1000))),
		warnings: []string{"extended partition 2: EBR at LBA 1012 lies past the disk's last LBA 127; the rest of the chain is ignored"},
	},

	// No partition table.
	{name: "zeros", size: "10M", build: func(testing.TB, string) {}, wantErr: ErrNoTable, errText: "no 0x55AA signature at byte 510"},
	{name: "less than a sector", size: "100", build: func(testing.TB, string) {}, wantErr: ErrNoTable, errText: "the disk is 100 bytes"},
	{
		name: "ext4", size: "10M",
		build:   func(t testing.TB, p string) { requireTools(t, "mkfs.ext4"); run(t, "", "mkfs.ext4", "-q", "-F", p) },
		wantErr: ErrNoTable, errText: "no 0x55AA signature",
	},
	{
		name: "vfat", size: "10M",
		build:   func(t testing.TB, p string) { requireTools(t, "mkfs.vfat"); run(t, "", "mkfs.vfat", p) },
		wantErr: ErrNoTable, errText: "an MBR signature but no partition in it",
	},
	{name: "empty MBR", size: "10M", build: sfdisk("label: dos\n"), wantErr: ErrNoTable, errText: "no partition in it"},
	{
		name: "boot sector", size: "10M",
		build:   steps(writeAt(510, []byte{0x55, 0xaa}), writeAt(mbrRecord(0, 3, 0), []byte("boot code"))),
		wantErr: ErrNoTable, errText: "BootIndicator 0x62 of MBR record 3 at byte 478 is neither 0x00 nor 0x80",
	},
}

// makeDisk builds c's disk in dir and returns its path and the oracle's
// view of it (nil when the case expects an error).
func makeDisk(t testing.TB, dir string, c diskCase) (string, *oracle) {
	t.Helper()
	path := newDisk(t, dir, "disk.img", c.size)
	c.build(t, path)
	var o *oracle
	if c.wantErr == nil {
		get := c.oracle
		if get == nil {
			get = func(t testing.TB, path string, _ int) oracle { return sfdiskOracle(t, path) }
		}
		v := get(t, path, c.sectorSize)
		o = &v
	}
	if c.damage != nil {
		c.damage(t, path)
	}
	return path, o
}

// TestRead reads each case's disk with its sector size and with detection,
// and compares with util-linux, field by field.
func TestRead(t *testing.T) {
	requireTools(t, "sfdisk", "fdisk", "partx", "truncate")
	for _, c := range diskCases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			path, o := makeDisk(t, t.TempDir(), c)
			for _, ss := range []int{c.sectorSize, 0} {
				// Detection (sectorSize 0) must find the disk's block
				// size and so give the same answer.
				if ss == 0 && (c.sectorSize == 0 || c.noDetect) {
					continue
				}
				t.Run(fmt.Sprintf("sectorSize=%d", ss), func(t *testing.T) {
					got, err := readDisk(t, path, ss)
					if c.wantErr != nil {
						if !errors.Is(err, c.wantErr) || !strings.Contains(fmt.Sprint(err), c.errText) {
							t.Fatalf("Read: got %v, %v; want an error wrapping %q saying %q", got, err, c.wantErr, c.errText)
						}
						return
					}
					if err != nil {
						t.Fatalf("Read: %v", err)
					}
					checkTable(t, got, c, o)
				})
			}
		})
	}
}

func checkTable(t *testing.T, got *Table, c diskCase, o *oracle) {
	t.Helper()
	if got.Scheme != o.Scheme || got.SectorSize != c.sectorSize {
		t.Errorf("got scheme %q, sector size %d; want %q, %d", got.Scheme, got.SectorSize, o.Scheme, c.sectorSize)
	}
	if o.DiskID != "" && got.DiskID != o.DiskID {
		t.Errorf("got disk id %q, want %q", got.DiskID, o.DiskID)
	}
	var want []Partition
	for _, p := range o.Partitions {
		if _, ok := c.refused[p.Number]; !ok && p.Number <= MaxNumber {
			want = append(want, p)
		}
	}
	if len(got.Partitions) != len(want) {
		t.Errorf("got %d partitions, want %d:\ngot  %+v\nwant %+v", len(got.Partitions), len(want), got.Partitions, want)
	}
	for i := range min(len(got.Partitions), len(want)) {
		g, w := got.Partitions[i], want[i]
		g.TypeName = "" // checked against sfdisk --list-types by TestTypeNames
		if g != w {
			t.Errorf("partition %d:\ngot  %+v\nwant %+v", w.Number, g, w)
		}
	}

	// Every expected warning is there, and no other.
	var expect []string
	for n, why := range c.refused {
		expect = append(expect, fmt.Sprintf("partition %d refused: %s", n, why))
	}
	expect = append(expect, c.warnings...)
	used := make([]bool, len(got.Warnings))
	for _, e := range expect {
		found := false
		for i, w := range got.Warnings {
			if strings.Contains(w, e) {
				found, used[i] = true, true
			}
		}
		if !found {
			t.Errorf("no warning says %q; warnings:\n%s", e, strings.Join(got.Warnings, "\n"))
		}
	}
	for i, w := range got.Warnings {
		if !used[i] {
			t.Errorf("unexpected warning %q", w)
		}
	}
}

// TestTypeNames checks every type name against sfdisk's list.
func TestTypeNames(t *testing.T) {
	requireTools(t, "sfdisk")
	list := func(label string) map[string]string {
		m := map[string]string{}
		for line := range strings.Lines(run(t, "", "sfdisk", "--list-types", "--label", label)) {
			code, name, ok := strings.Cut(strings.TrimSpace(line), "  ")
			if ok {
				m[strings.ToLower(code)] = strings.TrimSpace(name)
			}
		}
		return m
	}
	gpt, dos := list("gpt"), list("dos")
	for guid, name := range gptTypeNames {
		if want := gpt[guid]; want != name {
			t.Errorf("GPT type %s: name %q, sfdisk says %q", guid, name, want)
		}
	}
	for b, name := range mbrTypeNames {
		if want := dos[fmt.Sprintf("%x", b)]; want != name {
			t.Errorf("MBR type %#02x: name %q, sfdisk says %q", b, name, want)
		}
	}
}

// TestDecodeName covers what sfdisk cannot write: libfdisk 2.38 drops a
// name with a character outside the Basic Multilingual Plane.
func TestDecodeName(t *testing.T) {
	for _, c := range []struct {
		units []uint16
		want  string
	}{
		{nil, ""},
		{[]uint16{'a', 0, 'b'}, "a"},
		{[]uint16{'a', 0xd83d, 0xde00, 'z'}, "a\U0001F600z"},
		{[]uint16{'a', 0xd83d, 'z'}, "a\uFFFDz"}, // an unpaired surrogate
	} {
		var name [gptEntryNameChars]uint16
		copy(name[:], c.units)
		if got := decodeName(name[:]); got != c.want {
			t.Errorf("decodeName(%x) = %q, want %q", c.units, got, c.want)
		}
	}
}

// TestReadArguments checks the arguments Read refuses and reader failures.
func TestReadArguments(t *testing.T) {
	disk := bytes.NewReader(make([]byte, 4096))
	for _, ss := range []int{1, 511, 1000, 131072} {
		if _, err := Read(disk, 4096, ss); err == nil || errors.Is(err, ErrNoTable) || errors.Is(err, ErrCorrupt) {
			t.Errorf("Read(sectorSize %d) = %v, want an argument error", ss, err)
		}
	}
	if _, err := Read(disk, -1, 512); err == nil {
		t.Errorf("Read(size -1) succeeded")
	}
	// A reader shorter than the size it is said to have fails with an
	// I/O error, not a verdict on the table.
	_, err := Read(bytes.NewReader(make([]byte, 100)), 4096, 512)
	if err == nil || errors.Is(err, ErrNoTable) || errors.Is(err, ErrCorrupt) {
		t.Errorf("Read(short reader) = %v, want an I/O error", err)
	}
}
