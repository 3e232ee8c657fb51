package qcow2_test

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestMalformedHeaders damages one header field at a time in a qemu-made
// image. qemu-img refuses each damaged image (the oracle); Open must refuse
// it too, with an error that names the file and the field.
func TestMalformedHeaders(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name      string
		off       int64
		size      int
		val       uint64
		field     string // in the error message
		sentinel  error
		qemuFails bool // qemu-img refuses the image too
	}{
		{"cluster bits too small", qemu.HeaderClusterBits, 4, 8, "cluster_bits", qcow2.ErrCorrupt, true},
		{"cluster bits too large", qemu.HeaderClusterBits, 4, 22, "cluster_bits", qcow2.ErrCorrupt, true},
		{"version 4", qemu.HeaderVersion, 4, 4, "version 4", qcow2.ErrUnsupported, true},
		{"L1 table too large", qemu.HeaderL1Size, 4, 0x10000000, "l1_size", qcow2.ErrCorrupt, true},
		{"L1 table too small", qemu.HeaderL1Size, 4, 0, "l1_size", qcow2.ErrCorrupt, true},
		{"L1 offset unaligned", qemu.HeaderL1TableOffset, 8, 0x30200, "l1_table_offset", qcow2.ErrCorrupt, true},
		// qemu pads reads past the end of the file with zeros and so
		// accepts this; the L1 table is not in the file, so we refuse.
		{"L1 offset past EOF", qemu.HeaderL1TableOffset, 8, 0x100000000, "l1_table_offset", qcow2.ErrCorrupt, false},
		{"refcount order 7", qemu.HeaderRefcountOrder, 4, 7, "refcount_order", qcow2.ErrCorrupt, true},
		{"header too short", qemu.HeaderHeaderLength, 4, 96, "header_length", qcow2.ErrCorrupt, true},
		{"unknown incompatible bit", qemu.HeaderIncompatibleFeatures, 8, 0x20, "unknown incompatible feature", qcow2.ErrUnsupported, true},
		{"unknown compression type", qemu.HeaderCompressionType, 1, 2, "compression_type", qcow2.ErrCorrupt, true},
		{"too many snapshots", qemu.HeaderNbSnapshots, 4, 70000, "nb_snapshots", qcow2.ErrCorrupt, true},
		{"unknown encryption", qemu.HeaderCryptMethod, 4, 3, "crypt_method", qcow2.ErrCorrupt, true},
		{"snapshot table unaligned", qemu.HeaderSnapshotsOffset, 8, 0x30200, "snapshots_offset", qcow2.ErrCorrupt, true},
		{"refcount table unaligned", qemu.HeaderRefcountTableOffset, 8, 0x30200, "refcount_table_offset", qcow2.ErrCorrupt, true},
		{"image too big", qemu.HeaderSize, 8, 1 << 62, "size", qcow2.ErrCorrupt, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "-")+".qcow2")
			qemu.Create(t, "qcow2", p, "64M")
			qemu.PatchU(t, p, tc.off, tc.size, tc.val)
			qemuErr := exec.Command("qemu-img", "info", p).Run()
			if (qemuErr != nil) != tc.qemuFails {
				t.Fatalf("qemu-img info: %v; this case expects it to fail: %v", qemuErr, tc.qemuFails)
			}
			img, err := qcow2.Open(p, qcow2.Options{})
			if err == nil {
				img.Close()
				t.Fatal("Open succeeded")
			}
			if !errors.Is(err, tc.sentinel) {
				t.Errorf("error %q is not %v", err, tc.sentinel)
			}
			if msg := err.Error(); !strings.Contains(msg, p) || !strings.Contains(msg, tc.field) {
				t.Errorf("error %q does not name the file and %q", msg, tc.field)
			}
			var fe *qcow2.FormatError
			if errors.As(err, &fe) && fe.Offset != tc.off {
				t.Errorf("error names byte offset %d, the field is at %d", fe.Offset, tc.off)
			}
		})
	}
}

// TestNotQcow2 checks the error for a file that is not an image at all.
func TestNotQcow2(t *testing.T) {
	p := filepath.Join(t.TempDir(), "x.raw")
	os.WriteFile(p, []byte("hello"), 0o644)
	if _, err := qcow2.Open(p, qcow2.Options{}); !errors.Is(err, qcow2.ErrNotQcow2) {
		t.Fatalf("Open(raw file) = %v, want ErrNotQcow2", err)
	}
}
