package test

import (
	"encoding/binary"
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

// refcountEntryOffset returns where the refcount of host cluster c is
// stored, for 16-bit refcounts in the first refcount block.
func refcountEntryOffset(t *testing.T, path string, c int64) int64 {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var b [8]byte
	f.ReadAt(b[:], 48) // refcount_table_offset
	rt := int64(binary.BigEndian.Uint64(b[:]))
	f.ReadAt(b[:], rt)
	block := int64(binary.BigEndian.Uint64(b[:]) &^ 0x1ff)
	return block + 2*c
}

func readU(t *testing.T, path string, off int64, size int) uint64 {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 8)
	f.ReadAt(b[8-size:], off)
	return binary.BigEndian.Uint64(b)
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
			_, e := l2EntryOffset(t, p, 0)
			at := refcountEntryOffset(t, p, int64(e&0x00fffffffffffe00)/cs)
			patchU(t, p, at, 2, readU(t, p, at, 2)-1)
		},
		"refcount-incremented": func(p string) {
			_, e := l2EntryOffset(t, p, 1)
			at := refcountEntryOffset(t, p, int64(e&0x00fffffffffffe00)/cs)
			patchU(t, p, at, 2, readU(t, p, at, 2)+1)
		},
		"l2-into-l1": func(p string) {
			at, e := l2EntryOffset(t, p, 2)
			l1 := readU(t, p, 40, 8)
			patchU(t, p, at, 8, e&^0x00fffffffffffe00|l1)
		},
		"shared-cluster": func(p string) {
			_, e0 := l2EntryOffset(t, p, 0)
			at, _ := l2EntryOffset(t, p, 3)
			patchU(t, p, at, 8, e0)
		},
		"table-past-eof": func(p string) {
			l1 := int64(readU(t, p, 40, 8))
			patchU(t, p, l1, 8, 1<<63|1<<40)
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
