package qcow2_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// The hostile write matrix: every kind of table as the target of every
// kind of pointer, each followed by a write, a discard and a resize, on a
// qemu-made image with 4 KiB clusters, an internal snapshot and data
// written before and after it. Where the action goes through the bad
// pointer, it must fail (at once or at the flush after it) with the image
// marked corrupt, not one byte of the original file changed but the
// corrupt bit, and no leak that was not there before. The same action by
// qemu 7.2 (qemu-io, qemu-img resize) on a copy is the comparison: where
// qemu refuses, qcowfs must refuse too; where qemu goes ahead and qcowfs
// refuses, the difference is logged (docs/design.md, "Hostile images").

// hostileTargets are the tables of the base image a pointer is aimed at.
var hostileTargets = []string{"header", "L1 table", "L2 table", "refcount table", "refcount block", "snapshot table", "snapshot L1 table", "bitmap directory"}

// hostilePointers are the pointers aimed at a target, and the guest offset
// whose write or discard goes through them.
var hostilePointers = []struct {
	name string
	off  int64 // -1: any allocation goes through it
}{
	{"L1 entry", 2 << 20},
	{"L1 entry without COPIED", 2 << 20},
	{"L2 entry", 4096},
	{"L2 entry without COPIED", 4096},
	{"compressed descriptor", 4096},
	{"unaligned L2 entry", 4096},
	{"refcount table entry", -1},
}

type hostileBase struct {
	path    string
	targets map[string]int64
	l1, l2  int64 // the active L1 table and its first L2 table
	reft    int64
}

func makeHostileBase(t *testing.T, dir string) hostileBase {
	p := filepath.Join(dir, "base.qcow2")
	qemu.Create(t, "qcow2", p, "8M", "-o", "cluster_size=4096")
	qemu.IO(t, p, "write -P 0x11 0 1M")
	qemu.Img(t, "snapshot", "-c", "s", p)
	qemu.IO(t, p, "write -P 0x22 0 64k")
	qemu.Img(t, "bitmap", "--add", p, "b1")
	b := hostileBase{path: p, targets: map[string]int64{}}
	b.l1 = int64(qemu.ReadU(t, p, qemu.HeaderL1TableOffset, 8))
	b.l2 = int64(qemu.ReadU(t, p, b.l1, 8) & qemu.OffsetMask)
	b.reft = int64(qemu.ReadU(t, p, qemu.HeaderRefcountTableOffset, 8))
	snap := qemu.SnapshotEntryOffset(t, p, 0)
	b.targets["header"] = 0
	b.targets["L1 table"] = b.l1
	b.targets["L2 table"] = b.l2
	b.targets["refcount table"] = b.reft
	b.targets["refcount block"] = int64(qemu.ReadU(t, p, b.reft, 8) & qemu.OffsetMask)
	b.targets["snapshot table"] = int64(qemu.ReadU(t, p, qemu.HeaderSnapshotsOffset, 8))
	b.targets["snapshot L1 table"] = int64(qemu.ReadU(t, p, snap+qemu.SnapshotL1TableOffset, 8))
	_, _, b.targets["bitmap directory"], _ = qemu.BitmapDirectory(t, p)
	bitmapFlags = b.targets["bitmap directory"] + 12
	return b
}

// aim writes the pointer into the image at p, aimed at target.
func (b hostileBase) aim(t *testing.T, p, pointer string, target int64) {
	const copied = uint64(1) << 63
	switch pointer {
	case "L1 entry":
		qemu.PatchU(t, p, b.l1+8, 8, uint64(target)|copied)
	case "L1 entry without COPIED":
		qemu.PatchU(t, p, b.l1+8, 8, uint64(target))
	case "L2 entry":
		qemu.PatchU(t, p, b.l2+8, 8, uint64(target)|copied)
	case "L2 entry without COPIED":
		qemu.PatchU(t, p, b.l2+8, 8, uint64(target))
	case "compressed descriptor":
		// One sector at target (4 KiB clusters: the sector count
		// field is 4 bits above bit 58).
		qemu.PatchU(t, p, b.l2+8, 8, 1<<62|uint64(target))
	case "unaligned L2 entry":
		qemu.PatchU(t, p, b.l2+8, 8, uint64(target+512)|copied)
	case "refcount table entry":
		qemu.PatchU(t, p, b.reft, 8, uint64(target))
	default:
		t.Fatalf("pointer %q", pointer)
	}
}

// hostileOutcome is what one action did to one copy of a hostile image.
type hostileOutcome struct {
	err     error // of the action, or of the flush after it
	corrupt bool  // the header's corrupt bit is set afterwards
	changed int64 // the first byte of the original file that changed, -1: none
	leaks   int   // qemu-img check's leaks afterwards
}

func (o hostileOutcome) refused() bool { return o.err != nil }

func (o hostileOutcome) String() string {
	return fmt.Sprintf("err=%v corrupt=%v changed=%d leaks=%d", o.err != nil, o.corrupt, o.changed, o.leaks)
}

// bitmapFlags is where the base image's one bitmap keeps its flags (in
// its directory entry): a writer sets in_use there before its first write
// (bitmapwrite.go), as qemu does, so it may change like the corrupt bit.
var bitmapFlags int64

// observe fills in what the file looks like after an action.
func observe(t *testing.T, p string, before []byte, err error) hostileOutcome {
	o := hostileOutcome{err: err, changed: -1}
	after, rerr := os.ReadFile(p)
	if rerr != nil {
		t.Fatal(rerr)
	}
	o.corrupt = len(after) > 80 && after[qemu.HeaderIncompatibleFeatures+7]&2 != 0
	for i := range min(len(before), len(after)) {
		if i >= qemu.HeaderIncompatibleFeatures && i < qemu.HeaderIncompatibleFeatures+8 ||
			int64(i) >= bitmapFlags && int64(i) < bitmapFlags+4 {
			continue
		}
		if before[i] != after[i] {
			o.changed = int64(i)
			break
		}
	}
	if o.changed < 0 && len(after) < len(before) {
		o.changed = int64(len(after))
	}
	o.leaks = checkLeaks(t, p)
	return o
}

// checkLeaks returns the leaks qemu-img check counts in the image, -1 if
// it cannot tell.
func checkLeaks(t *testing.T, p string) int {
	out, _ := exec.Command("qemu-img", "check", "--output=json", p).Output()
	var res struct {
		Leaks int `json:"leaks"`
	}
	if err := json.Unmarshal(out, &res); err != nil {
		return -1
	}
	return res.Leaks
}

// actByQcowfs does the action through the library: open writable, act,
// flush, close.
func actByQcowfs(t *testing.T, p, action string, off int64) error {
	f, err := qcow2.OpenWritableFile(p)
	if err != nil {
		t.Fatal(err)
	}
	img, err := qcow2.NewImage(f, qcow2.Options{Writable: true, LenientTables: true, Cache: qcow2.NewCache(1<<20, 1<<20)})
	if err != nil {
		return fmt.Errorf("open: %w", err)
	}
	defer img.Close()
	if !img.Writable() {
		return fmt.Errorf("read-only: %s", img.ReadOnlyReason())
	}
	switch action {
	case "write":
		_, err = img.WriteAt(bytes.Repeat([]byte{0x5a}, 4096), off)
	case "discard":
		err = img.Discard(off, 4096)
	case "resize":
		err = img.Resize(16 << 20)
	}
	if err == nil {
		err = img.Flush()
	}
	if cerr := img.Close(); err == nil {
		err = cerr
	}
	return err
}

// actByQemu does the same with qemu 7.2's tools.
func actByQemu(t *testing.T, p, action string, off int64) error {
	var cmd *exec.Cmd
	switch action {
	case "write":
		cmd = exec.Command("qemu-io", "-f", "qcow2", "-c", fmt.Sprintf("write -P 0x5a %d 4096", off), p)
	case "discard":
		cmd = exec.Command("qemu-io", "-f", "qcow2", "-c", fmt.Sprintf("discard %d 4096", off), p)
	case "resize":
		cmd = exec.Command("qemu-img", "resize", "-f", "qcow2", p, "16M")
	}
	out, err := cmd.CombinedOutput()
	// qemu-io exits 0 when a command fails; its message says so.
	if err == nil && (strings.Contains(string(out), "failed") || strings.Contains(string(out), "error")) {
		err = errors.New(strings.TrimSpace(string(out)))
	}
	return err
}

func TestHostileWriteMatrix(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	dir := t.TempDir()
	base := makeHostileBase(t, dir)
	var differences []string
	for _, target := range hostileTargets {
		for _, ptr := range hostilePointers {
			switch {
			case (ptr.name == "refcount table entry" && target == "refcount block") || (strings.HasPrefix(ptr.name, "L1 entry") && target == "L2 table"):
				// A second claim of the same kind of table: not an
				// overlap of kinds (qemu-img check sees it, by counting).
				continue
			case target == "header" && ptr.name != "compressed descriptor" && ptr.name != "unaligned L2 entry":
				continue // offset 0 is no table, no cluster
			}
			for _, action := range []string{"write", "discard", "resize"} {
				name := fmt.Sprintf("%s to the %s, %s", ptr.name, target, action)
				t.Run(name, func(t *testing.T) {
					off := ptr.off
					if off < 0 { // any allocation; a discard frees cluster 0
						off = map[string]int64{"write": 6 << 20, "discard": 0}[action]
					}
					ours := filepath.Join(t.TempDir(), "ours.qcow2")
					theirs := filepath.Join(t.TempDir(), "theirs.qcow2")
					orig, _ := os.ReadFile(base.path)
					os.WriteFile(ours, orig, 0o644)
					base.aim(t, ours, ptr.name, base.targets[target])
					hostile, _ := os.ReadFile(ours)
					os.WriteFile(theirs, hostile, 0o644)
					leaksBefore := checkLeaks(t, ours)

					got := observe(t, ours, hostile, actByQcowfs(t, ours, action, off))
					q := observe(t, theirs, hostile, actByQemu(t, theirs, action, off))

					// Through the pointer: refused, corrupt, untouched.
					through := action != "resize" || ptr.name == "refcount table entry"
					// (An image refused at open is not written at all: it
					// needs no corrupt bit.)
					refusedAtOpen := got.err != nil && strings.HasPrefix(got.err.Error(), "open: ")
					if through {
						if !got.refused() || !got.corrupt && !refusedAtOpen || got.changed >= 0 || got.leaks > leaksBefore {
							t.Errorf("%s: %v (want refused, corrupt, nothing changed, no new leak; %d leaks before): %v", name, got, leaksBefore, got.err)
						}
					}
					// Never more lenient than qemu.
					if q.refused() && !got.refused() {
						t.Errorf("%s: qemu refuses (%v), qcowfs does not: %v", name, q.err, got)
					}
					if got.refused() != q.refused() || got.corrupt != q.corrupt || (got.changed < 0) != (q.changed < 0) {
						differences = append(differences, fmt.Sprintf("%-55s qcowfs %v; qemu %v", name, got, q))
					}
				})
			}
		}
	}
	t.Logf("where qemu 7.2 differs:\n%s", strings.Join(differences, "\n"))
}

// TestRefusedWriteLeaksNothing: a partial write into a compressed cluster
// whose stream is garbage fails (its copy-on-write cannot read the rest of
// the cluster), and after a clean close the fresh cluster it was given is
// not left allocated: qemu-img check finds no leak, and the cluster still
// reads as it did (an error).
func TestRefusedWriteLeaksNothing(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	p := filepath.Join(t.TempDir(), "c.qcow2")
	qemu.Create(t, "qcow2", p, "1M")
	qemu.IO(t, p, "write -c -P 0x51 0 64k", "write -c -P 0x52 64k 64k")
	_, e := qemu.L2EntryOffset(t, p, 0)
	const x = 62 - (16 - 8) // 64 KiB clusters
	stream := int64(e & (1<<x - 1))
	qemu.WriteAt(t, p, stream, bytes.Repeat([]byte{0xff}, 64))
	if leaks := checkLeaks(t, p); leaks != 0 {
		t.Fatalf("%d leaks before", leaks)
	}
	f, err := qcow2.OpenWritableFile(p)
	if err != nil {
		t.Fatal(err)
	}
	img, err := qcow2.NewImage(f, qcow2.Options{Writable: true})
	if err != nil || !img.Writable() {
		t.Fatal(err, img.ReadOnlyReason())
	}
	if _, err := img.WriteAt(make([]byte, 4096), 4096); err == nil {
		t.Fatal("a partial write into a broken compressed cluster succeeded")
	}
	if _, err := img.WriteAt(bytes.Repeat([]byte{7}, 4096), 256<<10); err != nil {
		t.Fatalf("a write elsewhere: %v", err)
	}
	if err := img.Close(); err != nil {
		t.Fatal(err)
	}
	if leaks := checkLeaks(t, p); leaks != 0 {
		out, _ := exec.Command("qemu-img", "check", p).CombinedOutput()
		t.Fatalf("%d leaks after a clean close:\n%s", leaks, out)
	}
}
