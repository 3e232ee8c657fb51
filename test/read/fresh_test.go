package read

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// readThrough reads the whole file at path (one open) and returns its
// bytes, its size as stat reports it, and its data runs as lseek
// SEEK_DATA/SEEK_HOLE report them.
func readThrough(t *testing.T, path string) ([]byte, int64, [][2]int64) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	runs := harness.SeekRuns(t, f, st.Size())
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b, st.Size(), runs
}

// TestServedFreshAfterChange: an image that qemu changes while none of its
// files is open in the mount (written, snapshotted, resized, compressed
// clusters rewritten, converted over) is served fresh at the next open:
// size, bytes and holes follow the new content, with nothing kept from the
// previous open (the kernel's page cache, L2 tables, decompressed
// clusters, the hole index).
func TestServedFreshAfterChange(t *testing.T) {
	harness.RequireFUSE(t)
	src := qemu.TempDir(t)
	work := t.TempDir()
	plain := filepath.Join(src, "plain.qcow2")
	qemu.Create(t, "qcow2", plain, "8M", "-o", "cluster_size=4096")
	qemu.IO(t, plain, "write -P 0x11 0 1M", "write -P 0x12 4M 64k")
	raw := filepath.Join(work, "patterns.raw")
	qemu.Create(t, "raw", raw, "4M")
	qemu.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x33 0 3M", raw)
	packed := filepath.Join(src, "packed.qcow2")
	qemu.Img(t, "convert", "-q", "-c", "-O", "qcow2", raw, packed)
	other := filepath.Join(work, "other.qcow2")
	qemu.Create(t, "qcow2", other, "6M")
	qemu.IO(t, other, "write -P 0x44 1M 2M")

	m := harness.Mount(t, src)
	check := func(what, image, name string) {
		t.Helper()
		want, err := os.ReadFile(qemu.ToRaw(t, image, filepath.Join(work, name+".expect")))
		if err != nil {
			t.Fatal(err)
		}
		got, size, runs := readThrough(t, filepath.Join(m.Dir, name+".raw"))
		if size != int64(len(want)) {
			t.Fatalf("%s: %s.raw is %d bytes, qemu says %d", what, name, size, len(want))
		}
		if i := harness.FirstDiff(got, want); i >= 0 {
			t.Fatalf("%s: %s.raw differs from qemu-img convert at byte %d", what, name, i)
		}
		if wantRuns := qemu.DataRuns(t, image); !slices.Equal(runs, wantRuns) {
			t.Fatalf("%s: %s.raw data runs %v, qemu-img map %v", what, name, runs, wantRuns)
		}
	}
	check("first open", plain, "plain")
	check("first open", packed, "packed")

	// Written where the page cache and the hole index have seen zeros
	// and data, and past the old end after a resize.
	qemu.IO(t, plain, "write -P 0x21 512k 8k", "write -z 4M 64k", "write -P 0x22 6M 4k")
	check("after qemu-io writes", plain, "plain")
	qemu.Img(t, "resize", "-q", plain, "12M")
	qemu.IO(t, plain, "write -P 0x23 10M 4k")
	check("after qemu-img resize", plain, "plain")
	qemu.Img(t, "snapshot", "-c", "later", plain)
	qemu.IO(t, plain, "write -P 0x24 0 4k")
	check("after a snapshot and a write", plain, "plain")
	if _, err := os.Stat(filepath.Join(m.Dir, "plain@later.raw")); err != nil {
		t.Errorf("the new snapshot is not shown: %v", err)
	}

	// Compressed clusters rewritten: the decompressed-cluster cache must
	// not answer for them.
	qemu.IO(t, packed, "discard 0 64k", "write -c -P 0x55 0 64k", "write -P 0x56 100k 3000")
	check("after compressed writes", packed, "packed")

	// Converted over: the same file name, other content.
	qemu.Img(t, "convert", "-O", "qcow2", other, plain)
	check("after qemu-img convert over it", plain, "plain")
}
