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

// TestSnapshotNotFoundGivesBackBudget: an open that fails because the
// snapshot asked for does not exist gives back every byte it charged to
// the budget (the snapshot table, read before the snapshot is looked up).
func TestSnapshotNotFoundGivesBackBudget(t *testing.T) {
	p := filepath.Join(t.TempDir(), "s.qcow2")
	qemu.Create(t, "qcow2", p, "1M")
	qemu.IO(t, p, "write -P 0x11 0 64k")
	qemu.Img(t, "snapshot", "-c", "one", p)
	for _, opts := range []qcow2.Options{{SnapshotIndex: 9}, {Snapshot: "none such"}} {
		opts.Budget = qcow2.NewBudget(qcow2.DefaultBudget)
		img, err := qcow2.Open(p, opts)
		if err == nil {
			img.Close()
			t.Fatalf("snapshot %q (index %d) opened; the image has one snapshot, \"one\"", opts.Snapshot, opts.SnapshotIndex)
		}
		if used := opts.Budget.Used(); used != 0 {
			t.Errorf("snapshot %q (index %d): %v; %d bytes still charged to the budget", opts.Snapshot, opts.SnapshotIndex, err, used)
		}
	}
}
