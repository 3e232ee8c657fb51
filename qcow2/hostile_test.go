package qcow2_test

import (
	"bytes"
	"context"
	"encoding/binary"
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

// Hostile images at the library level: each case damages a qemu-made image
// and asks qemu what it makes of it; the library must agree (refuse what
// qemu refuses to read, serve what qemu serves, byte for byte).

// qemuReads reports whether qemu opens the image for reading.
func qemuReads(t *testing.T, p string, args ...string) bool {
	t.Helper()
	cmd := exec.Command("qemu-io", append(append([]string{"-r"}, args...), "-c", "read 0 512", p)...)
	out, err := cmd.CombinedOutput()
	return err == nil && !bytes.Contains(out, []byte("can't open"))
}

// TestVirtualSizeInSectors: a size field that is not a whole number of
// sectors is served as qemu serves it, rounded down to a sector, and so is
// every figure derived from it.
func TestVirtualSizeInSectors(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "odd.qcow2")
	qemu.Create(t, "qcow2", p, "2M")
	qemu.IO(t, p, "write -P 0x41 0 2M")
	qemu.PatchU(t, p, qemu.HeaderSize, 8, 1<<20+123)
	want := int64(qemu.Info(t, p)["virtual-size"].(float64))
	raw := qemu.ToRaw(t, p, filepath.Join(dir, "odd.raw"))
	img, err := qcow2.Open(p, qcow2.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	if img.Size() != want {
		t.Errorf("Size() = %d, qemu-img info says %d", img.Size(), want)
	}
	if v := img.Info().VirtualSize; v != want {
		t.Errorf("Info().VirtualSize = %d, qemu-img info says %d", v, want)
	}
	compareWithRaw(t, img, raw)
	var end int64
	img.Map(context.Background(), func(e qcow2.MapEntry) error { end = e.Start + e.Length; return nil })
	if q := qemu.Map(t, p); end != q[len(q)-1].Start+q[len(q)-1].Length {
		t.Errorf("the map ends at %d, qemu-img map's at %d", end, q[len(q)-1].Start+q[len(q)-1].Length)
	}
}

// TestSnapshotsQemuCannotLoad: a snapshot qemu cannot load (its disk size
// is not a whole number of sectors, or needs a larger L1 table than qemu
// allows, or its L1 table lies outside the file) is listed but cannot be
// opened, and the image and its other snapshots read as qemu reads them.
func TestSnapshotsQemuCannotLoad(t *testing.T) {
	dir := t.TempDir()
	tmpl := filepath.Join(dir, "tmpl.qcow2")
	qemu.Create(t, "qcow2", tmpl, "1M")
	qemu.IO(t, tmpl, "write -P 0x11 0 64k")
	qemu.Img(t, "snapshot", "-c", "bad", tmpl)
	qemu.IO(t, tmpl, "write -P 0x12 64k 64k")
	qemu.Img(t, "snapshot", "-c", "good", tmpl)
	qemu.IO(t, tmpl, "write -P 0x13 128k 64k")
	for _, tc := range []struct {
		name  string
		field int64
		size  int
		val   uint64
		// qemu reads past the end of the file as zeros, so it loads
		// a snapshot whose L1 table lies there; we refuse it (its
		// table is not in the file), as we refuse such an active L1.
		qemuLoads bool
	}{
		{"odd disk size", qemu.SnapshotDiskSize, 8, 1<<20 + 64<<10 + 123, false},
		{"disk size 2^62", qemu.SnapshotDiskSize, 8, 1 << 62, false},
		{"L1 past the end", qemu.SnapshotL1TableOffset, 8, 1 << 40, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "-")+".qcow2")
			qemu.Run(t, "cp", tmpl, p)
			qemu.PatchU(t, p, qemu.SnapshotEntryOffset(t, p, 0)+tc.field, tc.size, tc.val)
			// The oracle: qemu applies the good snapshot and not
			// the bad one.
			for id, ok := range map[string]bool{"1": tc.qemuLoads, "2": true} {
				cp := filepath.Join(dir, "apply"+id+".qcow2")
				qemu.Run(t, "cp", p, cp)
				err := exec.Command("qemu-img", "snapshot", "-a", id, cp).Run()
				if (err == nil) != ok {
					t.Fatalf("qemu-img snapshot -a %s: %v; the case expects success %v", id, err, ok)
				}
			}
			img, err := qcow2.Open(p, qcow2.Options{})
			if err != nil {
				t.Fatalf("the image itself must open: %v", err)
			}
			defer img.Close()
			compareWithRaw(t, img, qemu.ToRaw(t, p, filepath.Join(dir, "active.raw")))
			if s := img.Snapshots(); len(s) != 2 || s[0].Err == nil || s[1].Err != nil {
				t.Fatalf("snapshots %+v: the first must carry its reason, the second none", s)
			}
			if bad, err := qcow2.Open(p, qcow2.Options{SnapshotIndex: 1}); err == nil {
				bad.Close()
				t.Errorf("opened a snapshot qemu cannot load")
			} else if !errors.Is(err, qcow2.ErrCorrupt) {
				t.Errorf("opening the bad snapshot: %v, want ErrCorrupt", err)
			}
			good, err := qcow2.Open(p, qcow2.Options{SnapshotIndex: 2})
			if err != nil {
				t.Fatal(err)
			}
			defer good.Close()
			compareWithRaw(t, good, qemu.ToRaw(t, filepath.Join(dir, "apply2.qcow2"), filepath.Join(dir, "good.raw")))
		})
	}
}

// TestBitmapLimitsOfQemu: bitmap directories that break qemu's limits are
// refused as qemu refuses them (qemu-io cannot open them), whatever
// memory they would take.
func TestBitmapLimitsOfQemu(t *testing.T) {
	dir := t.TempDir()
	tmpl := filepath.Join(dir, "tmpl.qcow2")
	qemu.Create(t, "qcow2", tmpl, "64M")
	qemu.Img(t, "bitmap", "--add", tmpl, "b0")
	qemu.Img(t, "bitmap", "--add", tmpl, "b1")
	qemu.IO(t, tmpl, "write -P 0x21 0 1M")
	_, _, dirOff, ext := qemu.BitmapDirectory(t, tmpl)
	for _, tc := range []struct {
		name string
		off  int64
		size int
		val  uint64
		// qemu reads past the end of the file as zeros; we refuse a
		// table that is not in the file.
		qemuReads bool
	}{
		{"70000 bitmaps", ext, 4, 70000, false},
		{"zero bitmaps", ext, 4, 0, false},
		{"fewer entries than bitmaps", ext, 4, 3, false},
		{"directory too large", ext + 8, 8, 1024*65535 + 8, false},
		{"table of 2^27 entries", dirOff + 8, 4, 1 << 27, false},
		{"table larger than 512 MiB of bitmap", dirOff + 8, 4, 8193, false},
		{"granularity 2^32", dirOff + 17, 1, 32, false},
		{"extra data", dirOff + 20, 4, 8, false},
		{"table past the end", dirOff, 8, 1 << 40, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "-")+".qcow2")
			qemu.Run(t, "cp", tmpl, p)
			qemu.PatchU(t, p, tc.off, tc.size, tc.val)
			if qemuReads(t, p) != tc.qemuReads {
				t.Fatalf("qemu-io reads the image: %v; the case expects %v", !tc.qemuReads, tc.qemuReads)
			}
			img, err := qcow2.Open(p, qcow2.Options{})
			if err == nil {
				img.Close()
				t.Fatal("Open succeeded")
			}
			if !errors.Is(err, qcow2.ErrCorrupt) || !strings.Contains(err.Error(), p) {
				t.Errorf("error %q: want ErrCorrupt naming the file", err)
			}
		})
	}
	// The untouched template opens, as qemu opens it.
	if !qemuReads(t, tmpl) {
		t.Fatal("qemu-io cannot read the template")
	}
	img, err := qcow2.Open(tmpl, qcow2.Options{})
	if err != nil {
		t.Fatal(err)
	}
	img.Close()
}

// TestManyBitmapsOneTable: hundreds of directory entries naming one table
// are within qemu's limits; the table is read once and the metadata map
// holds what it names once, so the image's memory stays small.
func TestManyBitmapsOneTable(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "many.qcow2")
	qemu.Create(t, "qcow2", p, "64M", "-o", "cluster_size=4096")
	qemu.Img(t, "bitmap", "--add", "-g", "4096", p, "b0")
	qemu.IO(t, p, "write -P 0x31 0 4M")
	n, _, dirOff, ext := qemu.BitmapDirectory(t, p)
	if n != 1 {
		t.Fatalf("%d bitmaps", n)
	}
	entry := make([]byte, 32)
	f, _ := os.Open(p)
	f.ReadAt(entry[:24], dirOff)
	f.Close()
	// 400 entries naming the same table, each with its own name, in a
	// new directory at the end of the file.
	const count = 400
	var d bytes.Buffer
	for i := 0; i < count; i++ {
		e := append([]byte(nil), entry[:24]...)
		name := fmt.Sprintf("b%03d", i)
		binary.BigEndian.PutUint16(e[18:], uint16(len(name)))
		d.Write(e)
		d.WriteString(name)
		d.Write(make([]byte, (8-(24+len(name))%8)%8))
	}
	st, _ := os.Stat(p)
	newDir := (st.Size() + 4095) &^ 4095
	qemu.WriteAt(t, p, newDir, d.Bytes())
	qemu.WriteAt(t, p, newDir+int64(d.Len()), make([]byte, 4096-d.Len()%4096))
	qemu.PatchU(t, p, ext, 4, count)
	qemu.PatchU(t, p, ext+8, 8, uint64(d.Len()))
	qemu.PatchU(t, p, ext+16, 8, uint64(newDir))
	if !qemuReads(t, p) {
		t.Fatal("qemu-io cannot read the image; the case expects it served")
	}
	budget := qcow2.NewBudget(qcow2.DefaultBudget)
	img, err := qcow2.Open(p, qcow2.Options{Budget: budget})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	if got := len(img.Bitmaps()); got != count {
		t.Errorf("%d bitmaps listed, want %d", got, count)
	}
	if used := budget.Used(); used > 256<<10 {
		t.Errorf("the image holds %d bytes of metadata structures; 400 entries naming one table need far less", used)
	}
	img.Close()
	if used := budget.Used(); used != 0 {
		t.Errorf("%d bytes still charged after Close", used)
	}
}

// TestCompressedStreamInMetadata: a compressed cluster whose stream lies
// in the header cluster is refused like an uncompressed one would be;
// qemu-img check sees the overlap too (the header cluster counted twice).
func TestCompressedStreamInMetadata(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "c.qcow2")
	qemu.Create(t, "qcow2", p, "1M")
	qemu.IO(t, p, "write -c -P 0x51 0 64k", "write -c -P 0x52 64k 64k")
	at, e := qemu.L2EntryOffset(t, p, 0)
	// Keep the sector count, point the stream at byte 0x100 of the file.
	const x = 62 - (16 - 8)
	qemu.PatchU(t, p, at, 8, e&^(1<<x-1)|0x100)
	if out, err := exec.Command("qemu-img", "check", p).CombinedOutput(); err == nil {
		t.Fatalf("qemu-img check finds nothing wrong:\n%s", out)
	}
	img, err := qcow2.Open(p, qcow2.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	buf := make([]byte, 4096)
	if _, err := img.ReadAt(buf, 0); !errors.Is(err, qcow2.ErrCorrupt) || !strings.Contains(err.Error(), "header") {
		t.Errorf("reading the cluster: %v; want ErrCorrupt naming the header", err)
	}
	if _, err := img.ReadAt(buf, 64<<10); err != nil || buf[0] != 0x52 {
		t.Errorf("reading the intact compressed cluster: %v, %#x", err, buf[0])
	}
}

// failingFile is a HostFile whose reads of [from, to) fail.
type failingFile struct {
	qcow2.HostFile
	from, to int64
}

func (f *failingFile) ReadAt(p []byte, off int64) (int, error) {
	if off < f.to && off+int64(len(p)) > f.from {
		return 0, errors.New("injected read error")
	}
	return f.HostFile.ReadAt(p, off)
}

// TestMetadataMapRequired: an image whose metadata map cannot be built (a
// table it needs cannot be read, or does not fit in the memory budget) is
// refused; without the map nothing would keep metadata out of guest data.
func TestMetadataMapRequired(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "m.qcow2")
	qemu.Create(t, "qcow2", p, "64M")
	qemu.IO(t, p, "write -P 0x61 0 1M")
	rt := int64(qemu.ReadU(t, p, qemu.HeaderRefcountTableOffset, 8))
	f, err := qcow2.OpenFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if img, err := qcow2.NewImage(&failingFile{HostFile: f, from: rt, to: rt + 1}, qcow2.Options{}); err == nil {
		img.Close()
		t.Error("opened an image whose refcount table cannot be read")
	} else if !strings.Contains(err.Error(), "injected") {
		t.Errorf("error %v does not carry the read error", err)
	}
	if img, err := qcow2.Open(p, qcow2.Options{Budget: qcow2.NewBudget(100)}); err == nil {
		img.Close()
		t.Error("opened an image over its memory budget")
	} else if !errors.Is(err, qcow2.ErrBudget) {
		t.Errorf("error %v is not ErrBudget", err)
	}
}
