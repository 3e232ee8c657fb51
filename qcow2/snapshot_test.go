package qcow2_test

import (
	"fmt"
	"path/filepath"
	"testing"

	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestSnapshotsMatchQemu opens every internal snapshot of the matrix's
// images and compares its bytes with qemu-img convert -l of that snapshot,
// and its list with qemu-img info.
func TestSnapshotsMatchQemu(t *testing.T) {
	dir := qemu.TempDir(t)
	found := 0
	for _, im := range qemu.Matrix(t, dir) {
		infoSnaps, _ := qemu.Info(t, im.Path)["snapshots"].([]any)
		img, err := qcow2.Open(im.Path, qcow2.Options{})
		if err != nil {
			t.Fatal(err)
		}
		snaps := img.Snapshots()
		img.Close()
		if len(snaps) != len(infoSnaps) {
			t.Fatalf("%s: %d snapshots, qemu-img info lists %d", im.Name, len(snaps), len(infoSnaps))
		}
		for i, s := range snaps {
			found++
			q := infoSnaps[i].(map[string]any)
			if q["id"] != s.ID || q["name"] != s.Name {
				t.Errorf("%s: snapshot %d is %q/%q, qemu-img info says %v/%v", im.Name, i, s.ID, s.Name, q["id"], q["name"])
			}
			t.Run(fmt.Sprintf("%s@%s", im.Name, s.ID), func(t *testing.T) {
				// The oracle: a copy of the image reverted to the
				// snapshot with qemu-img snapshot -a (which also
				// restores the snapshot's virtual size, where
				// qemu-img convert -l keeps the current one).
				tmp := t.TempDir()
				cp := filepath.Join(tmp, "copy.qcow2")
				qemu.Run(t, "cp", im.Path, cp)
				qemu.Img(t, "snapshot", "-a", s.ID, cp)
				raw := qemu.ToRaw(t, cp, filepath.Join(tmp, "snap.raw"))
				img, err := qcow2.Open(im.Path, qcow2.Options{Snapshot: s.ID})
				if err != nil {
					t.Fatal(err)
				}
				defer img.Close()
				compareWithRaw(t, img, raw)
			})
		}
	}
	if found < 2 {
		t.Fatalf("the matrix has %d snapshots; the test needs some", found)
	}
}
