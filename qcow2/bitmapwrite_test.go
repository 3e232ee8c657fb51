package qcow2_test

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// Persistent bitmaps kept true by the writer, with qemu as the oracle:
// qemu-nbd -B and qemu-img map tell which ranges each bitmap says are
// dirty, and that must be what the operations touched (qemu-io's before,
// the library's after), rounded out to each bitmap's granularity; a
// disabled bitmap stays as qemu left it.

// granules is a set of dirty ranges at a granularity, built from
// operations (the model).
type granules map[int64]bool

func (g granules) add(off, n, gran int64) {
	for i := off / gran; i <= (off+n-1)/gran; i++ {
		g[i] = true
	}
}

// ranges are the set's granules as merged [start, end) ranges within size.
func (g granules) ranges(gran, size int64) [][2]int64 {
	var keys []int64
	for k := range g {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var out [][2]int64
	for _, k := range keys {
		s, e := k*gran, min((k+1)*gran, size)
		if n := len(out); n > 0 && out[n-1][1] == s {
			out[n-1][1] = e
			continue
		}
		out = append(out, [2]int64{s, e})
	}
	return out
}

// bitmapImage makes an image with bitmaps b64k (enabled, 64 KiB),
// b1m (enabled, 1 MiB) and off (disabled, 64 KiB), with writes by qemu-io
// that the enabled ones record; snap adds an internal snapshot.
func bitmapImage(t *testing.T, dir string, snap bool, opts ...string) (string, map[string]granules, map[string]int64) {
	p := filepath.Join(dir, fmt.Sprintf("bm-%v.qcow2", snap))
	qemu.Create(t, "qcow2", p, "8M", opts...)
	qemu.Img(t, "bitmap", "--add", "-g", "65536", p, "b64k")
	qemu.Img(t, "bitmap", "--add", "-g", "1M", p, "b1m")
	qemu.Img(t, "bitmap", "--add", "-g", "65536", p, "off")
	qemu.IO(t, p, "write -P 1 100k 10k", "write -P 2 3M 4k")
	qemu.Img(t, "bitmap", "--disable", p, "off")
	gran := map[string]int64{"b64k": 65536, "b1m": 1 << 20, "off": 65536}
	model := map[string]granules{"b64k": {}, "b1m": {}, "off": {}}
	for name := range model {
		model[name].add(100<<10, 10<<10, gran[name])
		model[name].add(3<<20, 4<<10, gran[name])
	}
	if snap {
		qemu.Img(t, "snapshot", "-c", "s1", p)
	}
	return p, model, gran
}

func TestBitmapsKeptTrue(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io", "qemu-nbd")
	for _, tc := range []struct {
		snap bool
		opts []string
	}{{false, nil}, {true, nil}, {false, []string{"-o", "cluster_size=512"}}} {
		snap := tc.snap
		t.Run(fmt.Sprintf("snapshot=%v%v", snap, tc.opts), func(t *testing.T) {
			dir := t.TempDir()
			p, model, gran := bitmapImage(t, dir, snap, tc.opts...)
			img := openWritable(t, p)
			size := img.Size()
			for _, op := range qemu.Ops(11, 30, size, 65536) {
				apply(t, img, op)
				if op.Kind == qemu.OpWrite || op.Kind == qemu.OpZero || op.Kind == qemu.OpDiscard {
					for _, name := range []string{"b64k", "b1m"} {
						model[name].add(op.Off, op.Len, gran[name])
					}
				}
			}
			// In use while open, after a flush too.
			if err := img.Flush(); err != nil {
				t.Fatal(err)
			}
			if info := string(qemu.Img(t, "info", "-U", p)); strings.Count(info, "in-use") != 2 {
				t.Fatalf("the two enabled bitmaps are not in use while the image is written:\n%s", info)
			}
			// A live view made before the grow follows it.
			early, err := img.BitmapView("b64k")
			if err != nil {
				t.Fatal(err)
			}
			defer early.Close()
			// A grow past what the tables hold: 64 GiB needs two 64 KiB
			// data clusters at 64 KiB granularity (room in the table's
			// cluster), and 256 at 512 B clusters (a new table).
			if err := img.Resize(64 << 30); err != nil {
				t.Fatal(err)
			}
			size = 64 << 30
			if _, err := img.WriteAt(make([]byte, 4096), 40<<30); err != nil {
				t.Fatal(err)
			}
			for _, name := range []string{"b64k", "b1m"} {
				model[name].add(40<<30, 4096, gran[name])
			}
			// The live view says what the model says.
			for _, name := range []string{"b64k", "b1m"} {
				if got, want := viewRanges(t, img, name), model[name].ranges(gran[name], size); !slices.Equal(got, want) {
					t.Errorf("the live view of %s: %v, want %v", name, got, want)
				}
			}
			if got, want := ranges(early), model["b64k"].ranges(gran["b64k"], size); early.Size() != size || !slices.Equal(got, want) {
				t.Errorf("the live view of b64k made before the grow: %d bytes, %v; want %d, %v", early.Size(), got, size, want)
			}
			if err := img.Close(); err != nil {
				t.Fatal(err)
			}
			info := string(qemu.Img(t, "info", p))
			if strings.Contains(info, "in-use") {
				t.Errorf("a bitmap is still in use after a clean close:\n%s", info)
			}
			qemuCheck(t, p)
			ro, err := qcow2.Open(p, qcow2.Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer ro.Close()
			for _, name := range []string{"b64k", "b1m", "off"} {
				got := qemu.DirtyRanges(t, p, name)
				want := model[name].ranges(gran[name], size)
				if !slices.Equal(got, want) {
					t.Errorf("bitmap %s: qemu says dirty %v, want %v", name, got, want)
				}
				if view := viewRanges(t, ro, name); !slices.Equal(view, got) {
					t.Errorf("bitmap %s read from the file: %v, qemu says %v", name, view, got)
				}
			}
		})
	}
}

// TestBitmapsAfterCrash: an image written and flushed but never closed
// (the daemon killed) keeps its enabled bitmaps in use: qemu treats them
// as inconsistent; and this package opens it read-only, saying why.
func TestBitmapsAfterCrash(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	dir := t.TempDir()
	p, _, _ := bitmapImage(t, dir, false)
	img := openWritable(t, p)
	if _, err := img.WriteAt(make([]byte, 65536), 1<<20); err != nil {
		t.Fatal(err)
	}
	if err := img.Flush(); err != nil {
		t.Fatal(err)
	}
	crashed := filepath.Join(dir, "crashed.qcow2")
	b, _ := os.ReadFile(p)
	os.WriteFile(crashed, b, 0o644)
	img.Close()
	info := string(qemu.Img(t, "info", crashed))
	if strings.Count(info, "in-use") != 2 {
		t.Fatalf("the crashed image's enabled bitmaps are not in use:\n%s", info)
	}
	f, err := qcow2.OpenWritableFile(crashed)
	if err != nil {
		t.Fatal(err)
	}
	again, err := qcow2.NewImage(f, qcow2.Options{Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	if again.Writable() || !strings.Contains(again.ReadOnlyReason(), "in use") {
		t.Errorf("reopened writable (%q)", again.ReadOnlyReason())
	}
	if out, err := exec.Command("qemu-img", "check", crashed).CombinedOutput(); err != nil {
		t.Logf("qemu-img check of the crashed image: %v\n%s", err, out)
	}
}

// viewRanges lists the dirty ranges of a BitmapView.
func viewRanges(t *testing.T, img *qcow2.Image, name string) [][2]int64 {
	t.Helper()
	v, err := img.BitmapView(name)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	return ranges(v)
}

// ranges lists the dirty ranges of v.
func ranges(v *qcow2.BitmapView) [][2]int64 {
	var out [][2]int64
	for off := v.NextDirty(0); off < v.Size(); off = v.NextDirty(off) {
		end := v.NextClean(off)
		out = append(out, [2]int64{off, end})
		off = end
	}
	return out
}

// fullDisk is a host file on a full disk while full is set: growing it
// fails with ENOSPC.
type fullDisk struct {
	qcow2.WritableFile
	full atomic.Bool
}

func (f *fullDisk) Allocate(off, n int64) error {
	if f.full.Load() {
		return syscall.ENOSPC
	}
	return f.WritableFile.Allocate(off, n)
}

// TestBitmapsInUseAfterFailedStart: the first write of an image fails
// before anything is written (the host disk is full when the file is
// grown to its last cluster, which qemu leaves cut short); once there is
// room, the next write must still set the enabled bitmaps in use before
// it goes ahead: qemu-img info of the file as it is then (a crash) shows
// them in use.
func TestBitmapsInUseAfterFailedStart(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	dir := t.TempDir()
	p, _, _ := bitmapImage(t, dir, false)
	f, err := qcow2.OpenWritableFile(p)
	if err != nil {
		t.Fatal(err)
	}
	full := &fullDisk{WritableFile: f}
	img, err := qcow2.NewImage(full, qcow2.Options{Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	full.full.Store(true)
	if _, err := img.WriteAt(make([]byte, 4096), 1<<20); !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("the first write on a full disk: %v, want ENOSPC", err)
	}
	full.full.Store(false)
	if _, err := img.WriteAt(make([]byte, 4096), 1<<20); err != nil {
		t.Fatal(err)
	}
	if err := img.Flush(); err != nil {
		t.Fatal(err)
	}
	if info := string(qemu.Img(t, "info", "-U", p)); strings.Count(info, "in-use") != 2 {
		t.Fatalf("the enabled bitmaps are not in use while the image is written:\n%s", info)
	}
}

// TestCloseConcurrent: a written image with bitmaps closed by two callers
// at once (an unmount closing what a last user is closing) is closed once:
// both get the same result, the race detector finds nothing (it found
// closeBitmaps run twice at once), and the bitmaps end clean, not in use.
func TestCloseConcurrent(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	dir := t.TempDir()
	p, _, _ := bitmapImage(t, dir, false)
	img := openWritable(t, p)
	if _, err := img.WriteAt(make([]byte, 65536), 1<<20); err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 2)
	for range 2 {
		go func() { errs <- img.Close() }()
	}
	e1, e2 := <-errs, <-errs
	if e1 != nil || e2 != nil {
		t.Fatalf("Close: %v, %v", e1, e2)
	}
	if err := img.Close(); err != nil {
		t.Fatalf("a third Close: %v", err)
	}
	if info := string(qemu.Img(t, "info", p)); strings.Contains(info, "in-use") {
		t.Errorf("bitmaps in use after Close:\n%s", info)
	}
	qemu.CheckClean(t, p)
}
