package partition

import (
	"bytes"
	"encoding/binary"
	"errors"
	"flag"
	"io"
	"os"
	"os/exec"
	"slices"
	"sort"
	"sync/atomic"
	"testing"
)

// FuzzRead reads arbitrary disks: whatever the bytes, Read does not panic,
// reads a bounded amount, reports every failure as ErrNoTable or
// ErrCorrupt (the reader itself never fails), and returns only partitions
// that lie inside the disk and, extended containers aside, do not overlap.
//
// A disk is given sparsely (see encodeSparse) with its size, so that a seed
// can be a whole 60 MiB test disk in a few KiB: the fuzzer's minimizer,
// which runs on every new input, takes minutes over inputs of tens of KiB
// and would eat a short -fuzztime. sel picks the sector size passed to
// Read: detect, 512 or 4096.
func FuzzRead(f *testing.F) {
	for _, s := range seedDisks(f) {
		for sel := range uint8(3) {
			f.Add(s.data, s.size, sel)
		}
	}
	f.Add([]byte{}, int64(1<<20), uint8(0))
	f.Fuzz(func(t *testing.T, data []byte, size int64, sel uint8) {
		d := decodeSparse(data, size)
		ss := []int{0, 512, 4096}[sel%3]
		tb, err := Read(d, d.size, ss)

		// Bounded work: two GPT headers with their arrays, and then some
		// for sector-size detection; or the MBR and the EBRs.
		if max := int64(4*MaxEntryArray + MaxEBRs*mbrSize + 1<<20); d.read.Load() > max {
			t.Fatalf("Read read %d bytes, more than %d", d.read.Load(), max)
		}
		if err != nil {
			if !errors.Is(err, ErrNoTable) && !errors.Is(err, ErrCorrupt) {
				t.Fatalf("Read: %v: neither ErrNoTable nor ErrCorrupt", err)
			}
			if tb != nil {
				t.Fatalf("Read returned a table with error %v", err)
			}
			return
		}
		checkInvariants(t, tb, d.size, ss)
	})
}

// checkInvariants checks what every table Read returns must satisfy.
func checkInvariants(t *testing.T, tb *Table, size int64, ss int) {
	t.Helper()
	if tb.Scheme != "gpt" && tb.Scheme != "mbr" {
		t.Fatalf("scheme %q", tb.Scheme)
	}
	if ss != 0 && tb.SectorSize != ss || tb.SectorSize != 512 && tb.SectorSize != 4096 {
		t.Fatalf("sector size %d, asked for %d", tb.SectorSize, ss)
	}
	bs := int64(tb.SectorSize)
	var vols []Partition
	for i, p := range tb.Partitions {
		if p.Number < 1 || p.Number > MaxNumber || i > 0 && p.Number <= tb.Partitions[i-1].Number {
			t.Fatalf("partition numbers out of order or range: %+v", tb.Partitions)
		}
		if p.Start <= 0 || p.Size <= 0 || p.Start > size-p.Size || p.Start%bs != 0 || p.Size%bs != 0 {
			t.Fatalf("partition %d: bytes %d+%d, outside the disk of %d bytes or not in %d-byte blocks", p.Number, p.Start, p.Size, size, bs)
		}
		if p.Extended && tb.Scheme != "mbr" {
			t.Fatalf("partition %d: an extended partition in a %s table", p.Number, tb.Scheme)
		}
		if !p.Extended {
			vols = append(vols, p)
		}
	}
	slices.SortFunc(vols, func(a, b Partition) int { return int(a.Start>>9 - b.Start>>9) })
	for i := 1; i < len(vols); i++ {
		if a, b := vols[i-1], vols[i]; b.Start < a.Start+a.Size {
			t.Fatalf("partitions %d (%d+%d) and %d (%d+%d) overlap", a.Number, a.Start, a.Size, b.Number, b.Start, b.Size)
		}
	}
}

// maxSparseDisk is the largest disk FuzzRead makes: 1 TiB.
const maxSparseDisk = 1 << 40

// encodeSparse encodes a disk as its runs of bytes that are not zero: for
// each, a uvarint count of zero bytes before it, a uvarint length, and the
// bytes. Runs of fewer than 16 zeros stay inside the runs around them.
func encodeSparse(b []byte) []byte {
	var out []byte
	prev := 0 // the end of the previous run
	for i := 0; i < len(b); {
		if b[i] == 0 {
			i++
			continue
		}
		j, zeros := i, 0
		for ; j < len(b) && zeros < 16; j++ {
			if b[j] == 0 {
				zeros++
			} else {
				zeros = 0
			}
		}
		j -= zeros
		out = binary.AppendUvarint(out, uint64(i-prev))
		out = binary.AppendUvarint(out, uint64(j-i))
		out = append(out, b[i:j]...)
		prev, i = j, j
	}
	return out
}

// A sparseDisk is a disk decoded from encodeSparse's format: zeros but for
// its runs. It counts the bytes read from it.
type sparseDisk struct {
	runs []dataRun // by increasing offset, not overlapping
	size int64
	read atomic.Int64
}

type dataRun struct {
	off  int64
	data []byte
}

// decodeSparse decodes data, as far as it decodes, into a disk of size
// bytes, or of the size its runs need if more, but at most maxSparseDisk
// bytes: runs past that are dropped.
func decodeSparse(data []byte, size int64) *sparseDisk {
	d := &sparseDisk{size: min(max(size, 0), maxSparseDisk)}
	var off uint64
	for len(data) > 0 {
		gap, n := binary.Uvarint(data)
		if n <= 0 {
			break
		}
		data = data[n:]
		length, n := binary.Uvarint(data)
		if n <= 0 || length > uint64(len(data)-n) {
			break
		}
		data = data[n:]
		if gap > maxSparseDisk || off+gap > maxSparseDisk-length {
			break
		}
		off += gap
		d.runs = append(d.runs, dataRun{off: int64(off), data: data[:length]})
		data = data[length:]
		off += length
	}
	d.size = max(d.size, int64(off))
	return d
}

func (d *sparseDisk) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, errors.New("negative offset")
	}
	if off >= d.size {
		return 0, io.EOF
	}
	var err error
	if int64(len(p)) > d.size-off {
		p, err = p[:d.size-off], io.EOF
	}
	d.read.Add(int64(len(p)))
	clear(p)
	end := off + int64(len(p))
	i := sort.Search(len(d.runs), func(i int) bool { return d.runs[i].off+int64(len(d.runs[i].data)) > off })
	for ; i < len(d.runs) && d.runs[i].off < end; i++ {
		r := d.runs[i]
		if r.off >= off {
			copy(p[r.off-off:], r.data)
		} else {
			copy(p, r.data[off-r.off:])
		}
	}
	return len(p), err
}

// A seed is a disk as FuzzRead takes it.
type seed struct {
	data []byte // encodeSparse's format
	size int64
}

// seedCases are the test disks FuzzRead starts from.
var seedCases = []string{
	"gpt", "gpt tiny", "gpt 4096", "gpt primary header zeroed", "gpt disk grown", "gpt bad partitions",
	"mbr", "mbr tiny", "mbr 4096", "mbr EBR loop", "mbr overlap",
}

// seedDisks makes the seed cases' disks, or none if util-linux is missing
// (FuzzRead then starts from its plain seeds).
//
// Fuzz worker processes get their inputs from the coordinating process,
// never from f.Add, so they skip making the disks (seconds of sfdisk runs,
// repeated each time a worker starts).
func seedDisks(f *testing.F) []seed {
	if w := flag.Lookup("test.fuzzworker"); w != nil && w.Value.String() == "true" {
		return nil
	}
	for _, tool := range []string{"sfdisk", "fdisk", "truncate"} {
		if _, err := exec.LookPath(tool); err != nil {
			return nil
		}
	}
	var seeds []seed
	for _, c := range diskCases {
		if !slices.Contains(seedCases, c.name) {
			continue
		}
		c.oracle = func(testing.TB, string, int) oracle { return oracle{} } // not needed
		path, _ := makeDisk(f, f.TempDir(), c)
		b, err := os.ReadFile(path)
		if err != nil {
			f.Fatal(err)
		}
		seeds = append(seeds, seed{data: encodeSparse(b), size: int64(len(b))})
	}
	return seeds
}

// TestSparse checks that decodeSparse(encodeSparse(b)) reads as b.
func TestSparse(t *testing.T) {
	b := make([]byte, 10000)
	for _, i := range []int{0, 1, 5, 20, 21, 40, 511, 512, 4000, 4001, 4017, 9999} {
		b[i] = byte(i) | 1
	}
	d := decodeSparse(encodeSparse(b), 0)
	if d.size != 10000 {
		t.Fatalf("size %d, want 10000", d.size)
	}
	for _, r := range [][2]int{{0, 10000}, {3, 30}, {500, 20}, {4000, 17}, {9990, 10}} {
		p := make([]byte, r[1])
		if n, err := d.ReadAt(p, int64(r[0])); n != r[1] || err != nil && err != io.EOF || !bytes.Equal(p, b[r[0]:r[0]+r[1]]) {
			t.Errorf("ReadAt(%d, %d) = %d, %v, %x; want %x", r[0], r[1], n, err, p, b[r[0]:r[0]+r[1]])
		}
	}
}
