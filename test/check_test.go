package test

import (
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"syscall"
	"testing"

	"github.com/qcowfs/qcowfs/test/qemu"
)

// checkJSON runs a checker (qemu-img or qcowfs) with --output=json and
// returns its decoded output and exit status.
func checkJSON(t *testing.T, name string, args ...string) (map[string]any, int) {
	t.Helper()
	cmd := exec.Command(name, append([]string{"check", "--output=json"}, args...)...)
	out, err := cmd.Output()
	var m map[string]any
	if jerr := json.Unmarshal(out, &m); jerr != nil {
		t.Fatalf("%s check %v: %v; output %q", name, args, err, out)
	}
	return m, exitCode(err)
}

// checkImages is the matrix plus images the check must cover: snapshots
// (in the matrix), persistent bitmaps with dirty bits, compressed
// clusters, extended L2, external data files.
func checkImages(t *testing.T, dir string) []qemu.Image {
	images := qemu.StatusMatrix(t, dir)
	bm := filepath.Join(dir, "bitmaps.qcow2")
	qemu.Create(t, "qcow2", bm, "16M")
	qemu.Img(t, "bitmap", "--add", bm, "bm0")
	qemu.Img(t, "bitmap", "--add", "-g", "512k", bm, "bm1")
	qemu.IO(t, bm, "write -P 0x42 0 3M", "write -P 0x43 10M 64k")
	return append(images, qemu.Image{Name: "bitmaps", Path: bm})
}

// TestCheckMatchesQemu: on every clean image, qcowfs check prints what
// qemu-img check prints (JSON, every field) and exits the same way.
func TestCheckMatchesQemu(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	dir := qemu.TempDir(t)
	for _, im := range checkImages(t, dir) {
		t.Run(im.Name, func(t *testing.T) {
			want, wantCode := checkJSON(t, "qemu-img", im.Path)
			got, gotCode := checkJSON(t, qcowfsBin, im.Path)
			if !reflect.DeepEqual(got, want) || gotCode != wantCode {
				t.Errorf("qcowfs check (exit %d):\n%v\nqemu-img check (exit %d):\n%v", gotCode, got, wantCode, want)
			}
		})
	}
}

// TestCheckDamaged damages images on purpose; qcowfs check must find each
// problem with qemu-img check's classification (the same corruption and
// leak counts and exit status), and reading the damaged range through the
// mount must fail with EIO where it would otherwise hand out metadata.
func TestCheckDamaged(t *testing.T) {
	requireFUSE(t)
	src := qemu.TempDir(t)
	const cs = 65536
	base := filepath.Join(src, "base.qcow2.tmpl")
	qemu.Create(t, "qcow2", base, "8M")
	qemu.IO(t, base, "write -P 0x51 0 256k", "write -P 0x52 1M 64k")
	damage := map[string]func(p string){
		"refcount-decremented": func(p string) {
			_, e := qemu.L2EntryOffset(t, p, 0)
			at := qemu.RefcountEntryOffset(t, p, int64(e&0x00fffffffffffe00)/cs)
			qemu.PatchU(t, p, at, 2, qemu.ReadU(t, p, at, 2)-1)
		},
		"refcount-incremented": func(p string) {
			_, e := qemu.L2EntryOffset(t, p, 1)
			at := qemu.RefcountEntryOffset(t, p, int64(e&0x00fffffffffffe00)/cs)
			qemu.PatchU(t, p, at, 2, qemu.ReadU(t, p, at, 2)+1)
		},
		"l2-into-l1": func(p string) {
			at, e := qemu.L2EntryOffset(t, p, 2)
			l1 := qemu.ReadU(t, p, 40, 8)
			qemu.PatchU(t, p, at, 8, e&^0x00fffffffffffe00|l1)
		},
		"shared-cluster": func(p string) {
			_, e0 := qemu.L2EntryOffset(t, p, 0)
			at, _ := qemu.L2EntryOffset(t, p, 3)
			qemu.PatchU(t, p, at, 8, e0)
		},
		"table-past-eof": func(p string) {
			l1 := int64(qemu.ReadU(t, p, 40, 8))
			qemu.PatchU(t, p, l1, 8, 1<<63|1<<40)
		},
	}
	for name, f := range damage {
		p := filepath.Join(src, name+".qcow2")
		qemu.Run(t, "cp", base, p)
		f(p)
	}
	m := mountImages(t, src, "--allow-corrupt")
	for name := range damage {
		t.Run(name, func(t *testing.T) {
			p := filepath.Join(src, name+".qcow2")
			want, wantCode := checkJSON(t, "qemu-img", p)
			got, gotCode := checkJSON(t, qcowfsBin, p)
			if wantCode == 0 {
				t.Fatalf("qemu-img check finds nothing wrong with %s: %v", name, want)
			}
			for _, k := range []string{"corruptions", "leaks", "check-errors"} {
				if got[k] != want[k] {
					t.Errorf("%s: qcowfs check %s = %v, qemu-img check says %v", name, k, got[k], want[k])
				}
			}
			if gotCode != wantCode {
				t.Errorf("%s: qcowfs check exits %d, qemu-img check %d", name, gotCode, wantCode)
			}
		})
	}
	// Cluster 2 of l2-into-l1 points into the L1 table: reading it must
	// fail rather than return the table's bytes as guest data.
	f, err := os.Open(filepath.Join(m.Dir, "l2-into-l1.raw"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.ReadAt(make([]byte, 4096), 2*cs); !errors.Is(err, syscall.EIO) {
		t.Errorf("reading guest data that points into the L1 table: %v, want EIO", err)
	}
	if _, err := f.ReadAt(make([]byte, 4096), 0); err != nil {
		t.Errorf("reading intact data of the damaged image: %v", err)
	}
}
