package fat

import (
	"bytes"
	"compress/gzip"
	"io"
	"io/fs"
	"os"
	"testing"
)

// The parsers on hostile bytes: no panic, no read outside the partition,
// bounded work. Seeds are mkfs.fat and mcopy images (testdata, made with
// --invariant), their trailing zeros cut: the fuzzed partition is the
// input followed by zeros up to the size the seed had.

// zeroTail is data followed by zeros up to size; a read outside [0, size)
// fails the fuzz run.
type zeroTail struct {
	t    *testing.T
	data []byte
	size int64
}

func (z zeroTail) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 || off+int64(len(p)) > z.size {
		z.t.Fatalf("read of %d bytes at %d, outside the %d-byte partition", len(p), off, z.size)
	}
	clear(p)
	if off < int64(len(z.data)) {
		copy(p, z.data[off:])
	}
	return len(p), nil
}

func seeds(f *testing.F) [][]byte {
	var out [][]byte
	for _, n := range []string{"fat12", "fat16", "fat32"} {
		gz, err := os.ReadFile("testdata/" + n + ".img.gz")
		if err != nil {
			f.Fatal(err)
		}
		z, err := gzip.NewReader(bytes.NewReader(gz))
		if err != nil {
			f.Fatal(err)
		}
		b, err := io.ReadAll(z)
		if err != nil {
			f.Fatal(err)
		}
		out = append(out, b)
	}
	return out
}

func trim(b []byte) []byte { return bytes.TrimRight(b, "\x00") }

// FuzzImage opens a partition and walks it whole, reading every file.
func FuzzImage(f *testing.F) {
	for _, b := range seeds(f) {
		f.Add(trim(b), int64(len(b)))
	}
	f.Fuzz(func(t *testing.T, data []byte, size int64) {
		if size < int64(len(data)) || size > 64<<20 {
			size = int64(len(data))
		}
		fsys, err := Open(zeroTail{t, data, size}, size)
		if err != nil {
			return
		}
		files := 0
		fs.WalkDir(fsys, ".", func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return nil
			}
			if files++; files > 2000 {
				return fs.SkipAll
			}
			if _, err := d.Info(); err != nil || d.IsDir() {
				return nil
			}
			fl, err := fsys.Open(p)
			if err != nil {
				return nil
			}
			defer fl.Close()
			io.Copy(io.Discard, io.LimitReader(fl, 1<<20))
			return nil
		})
	})
}

// FuzzBootSector checks the boot sector parser alone.
func FuzzBootSector(f *testing.F) {
	for _, b := range seeds(f) {
		f.Add(b[:bootSectorLen], int64(len(b)))
	}
	f.Fuzz(func(t *testing.T, b []byte, size int64) {
		g, err := parseBoot(b, size)
		if err != nil {
			return
		}
		if g.maxCluster <= firstCluster || g.dataStart+int64(g.maxCluster-firstCluster)*g.clusterSize > size ||
			g.fatStart+g.fatLen > size || (g.bits == 32 && (g.rootCluster < 2 || g.rootCluster >= g.maxCluster)) {
			t.Fatalf("parseBoot accepted a layout outside %d bytes: %+v", size, g)
		}
	})
}

// FuzzDirectory parses directory bytes: long names, short names, dots.
func FuzzDirectory(f *testing.F) {
	for _, b := range seeds(f) {
		// The root directory region of the FAT12 and FAT16 seeds.
		g, err := parseBoot(b, int64(len(b)))
		if err != nil || g.bits == 32 {
			continue
		}
		f.Add(b[g.rootStart:min(g.dataStart, g.rootStart+1024)], false)
	}
	f.Fuzz(func(t *testing.T, b []byte, fat32 bool) {
		if len(b) > maxDirBytes {
			return
		}
		pd := parseDir(b, fat32)
		seen := map[int]bool{}
		for _, e := range pd.entries {
			if e.index < 0 || e.index >= len(b)/direntLen || seen[e.index] {
				t.Fatalf("entry index %d in %d entries, or twice", e.index, len(b)/direntLen)
			}
			seen[e.index] = true
			if e.name() == "" && badName(e.name()) == "" {
				t.Fatal("an empty name passed as good")
			}
		}
		if pd.subdirs > len(b)/direntLen {
			t.Fatalf("%d subdirectories in %d entries", pd.subdirs, len(b)/direntLen)
		}
	})
}
