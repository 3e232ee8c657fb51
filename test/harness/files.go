package harness

// Reading what a mount shows: folders, files opened for the test, bytes,
// data runs.

import (
	"bytes"
	"errors"
	"io"
	"os"
	"sort"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// ReadNames lists dir (readdir only, nothing is stat'ed), sorted.
func ReadNames(dir string) ([]string, error) {
	f, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	names, err := f.Readdirnames(-1)
	sort.Strings(names)
	return names, err
}

// Names lists dir, sorted; an error fails the test.
func Names(t testing.TB, dir string) []string {
	t.Helper()
	names, err := ReadNames(dir)
	if err != nil {
		t.Fatal(err)
	}
	return names
}

// Open opens path for reading and closes it when the test ends; an error
// fails the test.
func Open(t testing.TB, path string) *os.File {
	t.Helper()
	return OpenFile(t, path, os.O_RDONLY)
}

// OpenFile is Open with flag (os.O_RDWR, unix.O_DIRECT, ...).
func OpenFile(t testing.TB, path string, flag int) *os.File {
	t.Helper()
	f, err := os.OpenFile(path, flag, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// FileRuns are the data runs of the file at path: SeekRuns over all of it,
// by a descriptor of its own, which stays open until the test ends (Open).
func FileRuns(t testing.TB, path string) [][2]int64 {
	t.Helper()
	f := Open(t, path)
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	return SeekRuns(t, f, st.Size())
}

// SameFile compares two files byte by byte and reports the first
// difference. It reads only where either file has data (by lseek
// SEEK_DATA/SEEK_HOLE), so terabyte sparse files compare quickly; where
// both have holes, both read as zeros.
func SameFile(t testing.TB, got, want string) {
	t.Helper()
	a, err := os.Open(got)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := os.Open(want)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	sa, _ := a.Stat()
	sb, _ := b.Stat()
	if sa.Size() != sb.Size() {
		t.Fatalf("%s is %d bytes, %s is %d", got, sa.Size(), want, sb.Size())
	}
	size := sa.Size()
	// nextData is where f's next data at or after off starts (size if none).
	nextData := func(f *os.File, off int64) int64 {
		d, err := unix.Seek(int(f.Fd()), off, unix.SEEK_DATA)
		if err != nil {
			return size
		}
		return d
	}
	nextHole := func(f *os.File, off int64) int64 {
		h, err := unix.Seek(int(f.Fd()), off, unix.SEEK_HOLE)
		if err != nil {
			return size
		}
		return h
	}
	bufA, bufB := make([]byte, 1<<20), make([]byte, 1<<20)
	for off := int64(0); off < size; {
		start := min(nextData(a, off), nextData(b, off))
		if start >= size {
			return
		}
		end := max(nextHole(a, start), nextHole(b, start))
		for pos := start; pos < end; {
			n := min(int64(len(bufA)), end-pos)
			if _, err := a.ReadAt(bufA[:n], pos); err != nil && err != io.EOF {
				t.Fatalf("reading %s at %d: %v", got, pos, err)
			}
			if _, err := b.ReadAt(bufB[:n], pos); err != nil && err != io.EOF {
				t.Fatalf("reading %s at %d: %v", want, pos, err)
			}
			if !bytes.Equal(bufA[:n], bufB[:n]) {
				for i := range bufA[:n] {
					if bufA[i] != bufB[i] {
						t.Fatalf("%s differs from %s at byte %d: %#x != %#x", got, want, pos+int64(i), bufA[i], bufB[i])
					}
				}
			}
			pos += n
		}
		off = end
	}
}

// NotInClear fails the test if the file at path holds b: data written to
// an encrypted image, which its files must not hold in the clear.
func NotInClear(t testing.TB, path string, b []byte) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(b) > 0 && bytes.Contains(data, b) {
		t.Errorf("%s holds written data in the clear", path)
	}
}

// FirstDiff returns the first index where a and b differ, -1 if none
// (the shorter one's end counts as a difference).
func FirstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	if len(a) != len(b) {
		return min(len(a), len(b))
	}
	return -1
}

// SeekRuns walks an open file of size bytes with SEEK_DATA/SEEK_HOLE, as
// cp does, and returns its data runs, [start, end) each.
func SeekRuns(t testing.TB, f *os.File, size int64) [][2]int64 {
	t.Helper()
	var runs [][2]int64
	fd := int(f.Fd())
	for off := int64(0); off < size; {
		d, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break
		}
		if err != nil {
			t.Fatalf("lseek(%d, SEEK_DATA): %v", off, err)
		}
		h, err := unix.Seek(fd, d, unix.SEEK_HOLE)
		if err != nil || h <= d {
			t.Fatalf("lseek(%d, SEEK_HOLE) = %d, %v", d, h, err)
		}
		runs = append(runs, [2]int64{d, h})
		off = h
	}
	return runs
}

// CountLines counts the lines of text (a daemon's log) that contain s.
func CountLines(text, s string) int {
	n := 0
	for _, line := range strings.Split(text, "\n") {
		if strings.Contains(line, s) {
			n++
		}
	}
	return n
}

// AlignedBlock returns an anonymous mapping of n bytes, aligned for
// O_DIRECT, unmapped when the test ends.
func AlignedBlock(t testing.TB, n int) []byte {
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(b) })
	return b
}
