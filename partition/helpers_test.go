package partition

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// The oracle for these tests is util-linux: disks are partitioned with
// sfdisk (fdisk for 4096-byte blocks, which sfdisk 2.38 cannot do on a
// file), and what a reader should see is what `sfdisk --json` (libfdisk) or
// `partx --pairs` (libblkid, which takes a sector size) list.

// requireTools fails the test under CI=true, and skips it elsewhere, when a
// tool is missing.
func requireTools(t testing.TB, names ...string) {
	t.Helper()
	for _, name := range names {
		if _, err := exec.LookPath(name); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("%s is missing (package fdisk, util-linux or e2fsprogs): %v", name, err)
			}
			t.Skipf("%s is missing: %v", name, err)
		}
	}
}

// run runs a command with stdin and returns its standard output; a failure
// fails the test with the command's standard error.
func run(t testing.TB, stdin string, name string, args ...string) string {
	t.Helper()
	out, errOut, err := runErr(stdin, name, args...)
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, errOut)
	}
	return out
}

func runErr(stdin string, name string, args ...string) (stdout, stderr string, err error) {
	cmd := exec.Command(name, args...)
	cmd.Stdin = strings.NewReader(stdin)
	cmd.Env = append(os.Environ(), "LC_ALL=C.UTF-8")
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	err = cmd.Run()
	return o.String(), e.String(), err
}

// sfdisk returns a build step feeding script to sfdisk.
func sfdisk(script string) func(testing.TB, string) {
	return func(t testing.TB, path string) {
		t.Helper()
		run(t, script, "sfdisk", "-q", path)
	}
}

// fdisk4096 returns a build step feeding commands to fdisk run with
// 4096-byte sectors.
func fdisk4096(commands string) func(testing.TB, string) {
	return func(t testing.TB, path string) {
		t.Helper()
		run(t, commands, "fdisk", "-b", "4096", path)
	}
}

// steps chains build steps.
func steps(fs ...func(testing.TB, string)) func(testing.TB, string) {
	return func(t testing.TB, path string) {
		t.Helper()
		for _, f := range fs {
			f(t, path)
		}
	}
}

// deletePartition deletes partition n with sfdisk --delete.
func deletePartition(n int) func(testing.TB, string) {
	return func(t testing.TB, path string) {
		t.Helper()
		run(t, "", "sfdisk", "-q", "--delete", path, strconv.Itoa(n))
	}
}

// truncateTo resizes the disk file.
func truncateTo(size string) func(testing.TB, string) {
	return func(t testing.TB, path string) {
		t.Helper()
		run(t, "", "truncate", "-s", size, path)
	}
}

// writeAt returns a step writing b at byte offset off (negative: from the
// end of the file).
func writeAt(off int64, b []byte) func(testing.TB, string) {
	return func(t testing.TB, path string) {
		t.Helper()
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if off < 0 {
			fi, err := f.Stat()
			if err != nil {
				t.Fatal(err)
			}
			off += fi.Size()
		}
		if _, err := f.WriteAt(b, off); err != nil {
			t.Fatal(err)
		}
	}
}

// flipByte returns a step inverting the bits of the byte at off (negative:
// from the end of the file): a damage that cannot be a no-op, whatever the
// byte was.
func flipByte(off int64) func(testing.TB, string) {
	return func(t testing.TB, path string) {
		t.Helper()
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if off < 0 {
			off += int64(len(b))
		}
		writeAt(off, []byte{^b[off]})(t, path)
	}
}

func le32(v uint32) []byte { return binary.LittleEndian.AppendUint32(nil, v) }
func le64(v uint64) []byte { return binary.LittleEndian.AppendUint64(nil, v) }

// mbrRecord is the byte offset of field off of MBR or EBR record slot (1-4)
// of the MBR at block lba (512-byte blocks).
func mbrRecord(lba int64, slot int, off int64) int64 {
	return lba*512 + 446 + 16*int64(slot-1) + off
}

// Offsets in an MBR partition record.
const (
	recOSType      = 4
	recStartingLBA = 8
	recSizeInLBA   = 12
)

// ebrLBAs walks the EBR chain of the first extended partition of a disk
// with 512-byte blocks and returns the EBRs' LBAs, so that tests can patch
// them. It is the textbook walk (link in the second record, relative to
// the extended partition), independent of the package's.
func ebrLBAs(t testing.TB, path string) []int64 {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	u32 := func(off int64) int64 { return int64(binary.LittleEndian.Uint32(b[off:])) }
	var ext int64 = -1
	for slot := 1; slot <= 4; slot++ {
		switch b[mbrRecord(0, slot, recOSType)] {
		case 0x05, 0x0f, 0x85:
			ext = u32(mbrRecord(0, slot, recStartingLBA))
		}
		if ext >= 0 {
			break
		}
	}
	if ext < 0 {
		t.Fatalf("%s: no extended partition", path)
	}
	var lbas []int64
	for lba := ext; len(lbas) < 100; {
		lbas = append(lbas, lba)
		link := u32(mbrRecord(lba, 2, recStartingLBA))
		if u32(mbrRecord(lba, 2, recSizeInLBA)) == 0 {
			return lbas
		}
		lba = ext + link
	}
	t.Fatalf("%s: EBR chain too long", path)
	return nil
}

// patchEBR returns a step writing b at byte off of record slot of the i-th
// EBR of the chain (i < 0 counts from the end).
func patchEBR(i, slot int, off int64, b []byte) func(testing.TB, string) {
	return func(t testing.TB, path string) {
		t.Helper()
		lbas := ebrLBAs(t, path)
		if i < 0 {
			i += len(lbas)
		}
		writeAt(mbrRecord(lbas[i], slot, off), b)(t, path)
	}
}

// gptEntryField is the byte offset of a field in a GPT entry.
const (
	entStartingLBA = 32
	entEndingLBA   = 40
)

// patchGPTEntry returns a step writing b at byte off of entry n (1-based)
// of the primary GPT of a disk with 512-byte blocks, then recomputing the
// primary's array and header CRCs, so that the primary stays valid (sfdisk,
// the oracle, checks that it does). The backup is left as it was.
func patchGPTEntry(n int, off int64, b []byte) func(testing.TB, string) {
	return func(t testing.TB, path string) {
		t.Helper()
		disk, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		h := disk[512:1024]
		le := binary.LittleEndian
		array := int64(le.Uint64(h[72:])) * 512
		num, esz := int64(le.Uint32(h[80:])), int64(le.Uint32(h[84:]))
		copy(disk[array+int64(n-1)*esz+off:], b)
		le.PutUint32(h[88:], crc32.ChecksumIEEE(disk[array:array+num*esz]))
		le.PutUint32(h[16:], 0)
		le.PutUint32(h[16:], crc32.ChecksumIEEE(h[:le.Uint32(h[12:])]))
		if err := os.WriteFile(path, disk, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// An oracle is a partition table as util-linux lists it.
type oracle struct {
	Scheme     string
	DiskID     string // "" when the tool does not say
	Partitions []Partition
}

// sfdiskJSON is the output of sfdisk --json.
type sfdiskJSON struct {
	PartitionTable struct {
		Label      string `json:"label"`
		ID         string `json:"id"`
		Device     string `json:"device"`
		SectorSize int64  `json:"sectorsize"`
		Partitions []struct {
			Node     string `json:"node"`
			Start    int64  `json:"start"`
			Size     int64  `json:"size"`
			Type     string `json:"type"`
			UUID     string `json:"uuid"`
			Name     string `json:"name"`
			Attrs    string `json:"attrs"`
			Bootable bool   `json:"bootable"`
		} `json:"partitions"`
	} `json:"partitiontable"`
}

// sfdiskOracle lists the disk's table with sfdisk --json. sfdisk itself
// falls back on the backup GPT (saying so on stderr), so an oracle taken
// after damage to the primary lists the backup's partitions.
func sfdiskOracle(t testing.TB, path string) oracle {
	t.Helper()
	var j sfdiskJSON
	if err := json.Unmarshal([]byte(run(t, "", "sfdisk", "--json", path)), &j); err != nil {
		t.Fatalf("sfdisk --json %s: %v", path, err)
	}
	pt := j.PartitionTable
	o := oracle{Scheme: map[string]string{"gpt": "gpt", "dos": "mbr"}[pt.Label], DiskID: strings.ToLower(pt.ID)}
	for _, p := range pt.Partitions {
		num, err := strconv.Atoi(strings.TrimPrefix(strings.TrimPrefix(p.Node, pt.Device), "p"))
		if err != nil {
			t.Fatalf("sfdisk node %q of %q: %v", p.Node, pt.Device, err)
		}
		q := Partition{Number: num, Start: p.Start * pt.SectorSize, Size: p.Size * pt.SectorSize,
			Name: p.Name, GUID: strings.ToLower(p.UUID), Bootable: p.Bootable}
		if o.Scheme == "gpt" {
			q.Type = strings.ToLower(p.Type)
			q.Attributes = sfdiskAttrs(t, p.Attrs)
		} else {
			v, err := strconv.ParseUint(p.Type, 16, 8)
			if err != nil {
				t.Fatalf("sfdisk type %q: %v", p.Type, err)
			}
			q.Type = fmt.Sprintf("0x%02x", v)
			q.Extended = v == 0x05 || v == 0x0f || v == 0x85
		}
		o.Partitions = append(o.Partitions, q)
	}
	return o
}

// sfdiskAttrs decodes sfdisk's GPT attribute string, as in
// "RequiredPartition LegacyBIOSBootable GUID:60,63".
func sfdiskAttrs(t testing.TB, s string) uint64 {
	var a uint64
	for _, f := range strings.Fields(s) {
		switch f {
		case "RequiredPartition":
			a |= 1 << 0
		case "NoBlockIOProtocol":
			a |= 1 << 1
		case "LegacyBIOSBootable":
			a |= 1 << 2
		default:
			bits, ok := strings.CutPrefix(f, "GUID:")
			if !ok {
				t.Fatalf("sfdisk attrs %q: unknown %q", s, f)
			}
			for _, b := range strings.Split(bits, ",") {
				n, err := strconv.Atoi(b)
				if err != nil || n < 0 || n > 63 {
					t.Fatalf("sfdisk attrs %q: bad bit %q", s, b)
				}
				a |= 1 << n
			}
		}
	}
	return a
}

var pairRE = regexp.MustCompile(`(\w+)="([^"]*)"`)

// partxOracle lists the disk's table with partx --pairs (libblkid), which,
// unlike sfdisk 2.38, can be told the sector size. partx gives START and
// SECTORS in 512-byte units whatever the sector size, FLAGS as the GPT
// attributes or the MBR boot indicator, and no disk id.
func partxOracle(t testing.TB, path string, sectorSize int) oracle {
	t.Helper()
	out := run(t, "", "partx", "--pairs", "--sector-size", strconv.Itoa(sectorSize), "--output",
		"NR,START,SECTORS,TYPE,NAME,UUID,FLAGS,SCHEME", path)
	var o oracle
	for line := range strings.Lines(out) {
		kv := map[string]string{}
		for _, m := range pairRE.FindAllStringSubmatch(line, -1) {
			kv[m[1]] = m[2]
		}
		num := atoi(t, kv["NR"])
		start, sectors := atoi(t, kv["START"]), atoi(t, kv["SECTORS"])
		flags, err := strconv.ParseUint(kv["FLAGS"], 0, 64)
		if err != nil {
			t.Fatalf("partx FLAGS %q: %v", kv["FLAGS"], err)
		}
		q := Partition{Number: num, Start: int64(start) * 512, Size: int64(sectors) * 512, Name: kv["NAME"]}
		switch kv["SCHEME"] {
		case "gpt":
			o.Scheme = "gpt"
			q.Type, q.GUID, q.Attributes = kv["TYPE"], kv["UUID"], flags
		case "dos":
			o.Scheme = "mbr"
			v, err := strconv.ParseUint(kv["TYPE"], 0, 8)
			if err != nil {
				t.Fatalf("partx TYPE %q: %v", kv["TYPE"], err)
			}
			q.Type = fmt.Sprintf("0x%02x", v)
			q.Extended = v == 0x05 || v == 0x0f || v == 0x85
			q.Bootable = flags == 0x80
		default:
			t.Fatalf("partx: scheme %q", kv["SCHEME"])
		}
		o.Partitions = append(o.Partitions, q)
	}
	return o
}

func atoi(t testing.TB, s string) int {
	n, err := strconv.Atoi(s)
	if err != nil {
		t.Fatalf("%q: %v", s, err)
	}
	return n
}

// readDisk runs Read on the disk file.
func readDisk(t testing.TB, path string, sectorSize int) (*Table, error) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	return Read(f, fi.Size(), sectorSize)
}

// newDisk makes an empty disk file of size (truncate's syntax) in dir.
func newDisk(t testing.TB, dir, name, size string) string {
	t.Helper()
	path := filepath.Join(dir, name)
	run(t, "", "truncate", "-s", size, path)
	return path
}
