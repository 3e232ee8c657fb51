package qemu

import (
	"encoding/binary"
	"os"
	"testing"
)

// Damaging images on purpose: tests take a qemu-made image and change one
// field, to see that qcowfs (and qemu, the oracle) refuse or report it.
// Offsets come from the specification (qemu's docs/interop/qcow2.rst,
// "Header"), written here independently of the code under test.
const (
	HeaderVersion               = 4
	HeaderBackingFileOffset     = 8
	HeaderBackingFileSize       = 16
	HeaderClusterBits           = 20
	HeaderSize                  = 24
	HeaderCryptMethod           = 32
	HeaderL1Size                = 36
	HeaderL1TableOffset         = 40
	HeaderRefcountTableOffset   = 48
	HeaderRefcountTableClusters = 56
	HeaderNbSnapshots           = 60
	HeaderSnapshotsOffset       = 64
	HeaderIncompatibleFeatures  = 72
	HeaderCompatibleFeatures    = 80
	HeaderAutoclearFeatures     = 88
	HeaderRefcountOrder         = 96
	HeaderHeaderLength          = 100
	HeaderCompressionType       = 104

	// L1 entries: bits 9-55 are the L2 table offset; L2 entries: bits
	// 9-55 the host cluster offset.
	OffsetMask = 0x00fffffffffffe00
)

// WriteAt overwrites bytes of a file.
func WriteAt(t testing.TB, path string, off int64, b []byte) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

// PatchU overwrites a big-endian integer of size bytes (1 to 8) at off.
func PatchU(t testing.TB, path string, off int64, size int, val uint64) {
	t.Helper()
	b := make([]byte, size)
	for i := range b {
		b[size-1-i] = byte(val >> (8 * i))
	}
	WriteAt(t, path, off, b)
}

// ReadU reads a big-endian integer of size bytes (1 to 8) at off.
func ReadU(t testing.TB, path string, off int64, size int) uint64 {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 8)
	if _, err := f.ReadAt(b[8-size:], off); err != nil {
		t.Fatalf("%s: reading %d bytes at %d: %v", path, size, off, err)
	}
	return binary.BigEndian.Uint64(b)
}

// SetIncompatible sets bits in the low byte of incompatible_features:
// 1 is dirty, 2 is corrupt, 4 external data file, 8 compression type, 16
// extended L2.
func SetIncompatible(t testing.TB, path string, bits byte) {
	t.Helper()
	v := ReadU(t, path, HeaderIncompatibleFeatures+7, 1)
	PatchU(t, path, HeaderIncompatibleFeatures+7, 1, v|uint64(bits))
}

// HeaderExtension returns the byte offset of the first header extension of
// type typ in a version 3 image, or fails the test.
func HeaderExtension(t testing.TB, path string, typ uint32) int64 {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	off := int64(binary.BigEndian.Uint32(b[HeaderHeaderLength:]))
	for off+8 <= int64(len(b)) {
		et := binary.BigEndian.Uint32(b[off:])
		n := int64(binary.BigEndian.Uint32(b[off+4:]))
		if et == typ {
			return off
		}
		if et == 0 {
			break
		}
		off += 8 + (n+7)&^7
	}
	t.Fatalf("%s: no header extension %#x", path, typ)
	return 0
}

// L2EntryOffset returns where the L2 entry of guest cluster n lies (n
// within the first L2 table, standard 8-byte entries), and the entry.
func L2EntryOffset(t testing.TB, path string, n int64) (int64, uint64) {
	t.Helper()
	l1 := int64(ReadU(t, path, HeaderL1TableOffset, 8))
	l2 := int64(ReadU(t, path, l1, 8) & OffsetMask)
	if l2 == 0 {
		t.Fatalf("%s: the first L1 entry has no L2 table", path)
	}
	at := l2 + 8*n
	return at, ReadU(t, path, at, 8)
}

// RefcountEntryOffset returns where the refcount of host cluster c is
// stored, for 16-bit refcounts in the first refcount block.
func RefcountEntryOffset(t testing.TB, path string, c int64) int64 {
	t.Helper()
	rt := int64(ReadU(t, path, HeaderRefcountTableOffset, 8))
	block := int64(ReadU(t, path, rt, 8) &^ 0x1ff)
	return block + 2*c
}

// SnapshotEntryOffset returns where entry i of the snapshot table lies
// (specification, "Snapshots": 40 fixed bytes, extra data, ID, name, each
// entry padded to 8 bytes).
func SnapshotEntryOffset(t testing.TB, path string, i int) int64 {
	t.Helper()
	n := int(ReadU(t, path, HeaderNbSnapshots, 4))
	if i >= n {
		t.Fatalf("%s: snapshot %d of %d", path, i, n)
	}
	off := int64(ReadU(t, path, HeaderSnapshotsOffset, 8))
	for ; i > 0; i-- {
		idLen := int64(ReadU(t, path, off+SnapshotIDSize, 2))
		nameLen := int64(ReadU(t, path, off+SnapshotNameSize, 2))
		extra := int64(ReadU(t, path, off+SnapshotExtraDataSize, 4))
		off += (SnapshotFixedSize + extra + idLen + nameLen + 7) &^ 7
	}
	return off
}

// Snapshot entry fields, relative to the entry.
const (
	SnapshotL1TableOffset = 0
	SnapshotL1Size        = 8
	SnapshotIDSize        = 12 // id_str_size
	SnapshotNameSize      = 14
	SnapshotDateSec       = 16
	SnapshotExtraDataSize = 36
	SnapshotFixedSize     = 40 // the fixed part; the extra data follows
	SnapshotDiskSize      = 48 // in the extra data: vm_state_size_large, then disk_size
)

// BitmapDirectory returns the bitmaps extension's fields (specification,
// "Bitmaps extension"): nb_bitmaps, the directory's size and offset, and
// where the extension's data starts.
func BitmapDirectory(t testing.TB, path string) (n uint32, size, off, ext int64) {
	t.Helper()
	ext = HeaderExtension(t, path, 0x23852875) + 8
	return uint32(ReadU(t, path, ext, 4)), int64(ReadU(t, path, ext+8, 8)), int64(ReadU(t, path, ext+16, 8)), ext
}
