package write

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// logMount, when set, is the mount whose log applyThrough shows when an
// operation fails.
var logMount *harness.Mounted

// applyThrough applies op to the raw file f of a writable mount, the way
// programs do: pwrite, fallocate (punch, zero range), ftruncate, fsync.
func applyThrough(t *testing.T, f *os.File, op qemu.Op) {
	t.Helper()
	fd := int(f.Fd())
	var err error
	switch op.Kind {
	case qemu.OpWrite:
		var n int
		n, err = unix.Pwrite(fd, op.Data(), op.Off)
		if err == nil && int64(n) != op.Len {
			err = fmt.Errorf("short write: %d of %d", n, op.Len)
		}
	case qemu.OpDiscard:
		err = unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, op.Off, op.Len)
	case qemu.OpZero:
		err = unix.Fallocate(fd, unix.FALLOC_FL_ZERO_RANGE|unix.FALLOC_FL_KEEP_SIZE, op.Off, op.Len)
	case qemu.OpResize:
		err = unix.Ftruncate(fd, op.Off)
	case qemu.OpFlush:
		err = f.Sync()
	}
	if err != nil {
		if logMount != nil {
			t.Log(logMount.LogText(t))
		}
		t.Fatalf("%v through the mount: %v", op, err)
	}
}

// noteZeroed keeps zeroed, the clusters whose last operation discarded or
// zeroed them whole (qemu-img map must show them as zero), up to date
// with op, in an image of cluster size cs. A write through a mount with
// the writeback cache reaches the image as whole pages of the kernel's
// page cache: a cluster smaller than a page that shares one with a write
// is written too (with the zeros it reads as).
func noteZeroed(zeroed map[int64]bool, op qemu.Op, cs int64) {
	const page = 4096
	switch op.Kind {
	case qemu.OpWrite:
		start, end := op.Off/page*page, (op.Off+op.Len+page-1)/page*page
		for c := start / cs; c <= (end-1)/cs; c++ {
			delete(zeroed, c)
		}
	case qemu.OpDiscard, qemu.OpZero:
		for c := (op.Off + cs - 1) / cs; (c+1)*cs <= op.Off+op.Len; c++ {
			zeroed[c] = true
		}
	}
}

func fileSHA(t *testing.T, path string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}

// TestWriteThroughMount applies the write matrix's operations through a
// real writable mount: pwrite, fallocate punch and zero range, ftruncate
// and fsync on the raw files, several images open at once. After unmount:
// qemu-img check finds no errors and no leaks, qemu-img convert equals the
// raw model, snapshots and backing files are unchanged, and discarded or
// zeroed clusters are zero in qemu-img map.
func TestWriteThroughMount(t *testing.T) {
	src := harness.SourceDir(t)
	work := t.TempDir()
	images := qemu.WriteMatrix(t, src)
	type state struct {
		im     qemu.WriteImage
		f      *os.File
		model  []byte
		ops    []qemu.Op
		keep   map[string][32]byte
		snaps  map[string][]byte
		zeroed map[int64]bool
	}
	var all []*state
	for _, im := range images {
		s := &state{im: im, keep: map[string][32]byte{}, snaps: map[string][]byte{}, zeroed: map[int64]bool{}}
		for _, k := range im.Keep {
			s.keep[k] = fileSHA(t, k)
		}
		for _, sn := range im.Snapshots {
			p := filepath.Join(work, im.Name+"@"+sn)
			qemu.Img(t, "convert", "-l", "snapshot.name="+sn, "-O", "raw", im.Path, p)
			s.snaps[sn], _ = os.ReadFile(p)
		}
		s.model = qemu.RawBytes(t, im.Path)
		h := fnv.New64a()
		h.Write([]byte("mount " + im.Name))
		s.ops = qemu.Ops(h.Sum64(), 40, int64(len(s.model)), im.ClusterSize)
		all = append(all, s)
	}

	m := harness.Racy.Mount(t, src, "--writable")
	logMount = m
	for _, s := range all {
		p := filepath.Join(m.Dir, s.im.Name+".raw")
		st, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm()&0o200 == 0 {
			t.Fatalf("%s is not writable in a writable mount: %v", p, st.Mode())
		}
		if s.f, err = os.OpenFile(p, os.O_RDWR, 0); err != nil {
			t.Fatal(err)
		}
	}
	// Interleaved: every image has a file open for writing throughout.
	for i := 0; i < 40; i++ {
		for _, s := range all {
			op := s.ops[i]
			applyThrough(t, s.f, op)
			s.model = op.Apply(s.model)
			noteZeroed(s.zeroed, op, s.im.ClusterSize)
		}
	}
	for _, s := range all {
		// What the mount reads now is the model too (the kernel's page
		// cache, and reads through the daemon after it).
		got, err := os.ReadFile(filepath.Join(m.Dir, s.im.Name+".raw"))
		if err != nil {
			t.Fatal(err)
		}
		if i := harness.FirstDiff(got, s.model); i >= 0 {
			t.Errorf("%s: the mount reads differently from the model at byte %d", s.im.Name, i)
		}
		if err := s.f.Close(); err != nil {
			t.Errorf("%s: close: %v", s.im.Name, err)
		}
	}
	m.Unmount(t)

	for _, s := range all {
		t.Run(s.im.Name, func(t *testing.T) {
			checkModel(t, s.im.Path, s.model)
			for k, want := range s.keep {
				if fileSHA(t, k) != want {
					t.Errorf("backing file %s changed", k)
				}
			}
			for sn, want := range s.snaps {
				p := filepath.Join(work, s.im.Name+"@"+sn+".after")
				qemu.Img(t, "convert", "-l", "snapshot.name="+sn, "-O", "raw", s.im.Path, p)
				b, _ := os.ReadFile(p)
				if len(b) < len(want) || !bytes.Equal(b[:len(want)], want) || strings.Trim(string(b[len(want):]), "\x00") != "" {
					t.Errorf("snapshot %s reads differently after the writes", sn)
				}
			}
			if s.im.V2 && s.im.Backed {
				return // zeros over a backing file are written data there
			}
			for _, e := range qemu.Map(t, s.im.Path) {
				for c := e.Start / s.im.ClusterSize; c < (e.Start+e.Length)/s.im.ClusterSize; c++ {
					if s.zeroed[c] && (e.Data || !e.Zero) {
						t.Errorf("cluster %d was discarded or zeroed last, qemu-img map says %+v", c, e)
						break
					}
				}
			}
		})
	}
}

// TestWritableMountRules: in a writable mount, snapshots, plain files and
// the backing file of another image stay read-only (EROFS), images that
// cannot be written safely (a dirty one, one whose persistent bitmap is in
// use, one whose bitmaps extension is invalid) are shown read-only with a
// log line and stay unchanged, O_TRUNC and shrinking are refused, and
// without --writable nothing is writable. An image with valid bitmaps is
// writable.
func TestWritableMountRules(t *testing.T) {
	src := harness.SourceDir(t)
	img := qemu.Make(t, filepath.Join(src, "vm.qcow2"), "8M", "write -P 0x31 0 1M")
	qemu.Img(t, "snapshot", "-c", "snap", img)
	base := filepath.Join(src, "base.qcow2")
	qemu.Create(t, "qcow2", base, "8M")
	qemu.Create(t, "qcow2", filepath.Join(src, "over.qcow2"), "8M", "-b", "base.qcow2", "-F", "qcow2")
	dirty := filepath.Join(src, "dirty.qcow2")
	qemu.Create(t, "qcow2", dirty, "8M", "-o", "lazy_refcounts=on")
	qemu.SetIncompatible(t, dirty, 1)
	bitmap := func(name string) string {
		p := filepath.Join(src, name)
		qemu.Create(t, "qcow2", p, "8M")
		qemu.Img(t, "bitmap", "--add", p, "b0")
		return p
	}
	bitmap("bitmaps.qcow2")
	inUse := bitmap("inuse.qcow2")
	_, _, dirOff, _ := qemu.BitmapDirectory(t, inUse)
	qemu.PatchU(t, inUse, dirOff+12, 4, 3) // flags: in_use, auto
	invalid := bitmap("invalid.qcow2")
	qemu.PatchU(t, invalid, qemu.HeaderAutoclearFeatures, 8, 0)
	os.WriteFile(filepath.Join(src, "notes.txt"), []byte("hello\n"), 0o644)
	before := map[string][32]byte{}
	for _, p := range []string{base, dirty, inUse, invalid} {
		before[p] = fileSHA(t, p)
	}

	ro := harness.Mount(t, src)
	if _, err := os.OpenFile(filepath.Join(ro.Dir, "vm.raw"), os.O_RDWR, 0); !errors.Is(err, unix.EROFS) {
		t.Errorf("a read-only mount opens vm.raw for writing: %v", err)
	}
	ro.Unmount(t)

	m := harness.Mount(t, src, "--writable")
	for name, want := range map[string]unix.Errno{
		"vm@snap.raw": unix.EROFS, "notes.txt": unix.EROFS, "base.raw": unix.EROFS,
		"dirty.raw": unix.EROFS, "inuse.raw": unix.EROFS, "invalid.raw": unix.EROFS,
	} {
		f, err := os.OpenFile(filepath.Join(m.Dir, name), os.O_WRONLY, 0)
		if err == nil {
			f.Close()
		}
		if !errors.Is(err, want) {
			t.Errorf("open %s for writing: %v, want %v", name, err, want)
		}
		if st, err := os.Stat(filepath.Join(m.Dir, name)); err == nil && st.Mode().Perm()&0o222 != 0 {
			t.Errorf("%s shows write permission %v", name, st.Mode())
		}
	}
	// The writable ones really are.
	for _, name := range []string{"vm.raw", "over.raw", "bitmaps.raw"} {
		f, err := os.OpenFile(filepath.Join(m.Dir, name), os.O_RDWR, 0)
		if err != nil {
			t.Errorf("open %s for writing: %v", name, err)
			continue
		}
		if _, err := f.WriteAt([]byte("hi"), 4096); err != nil {
			t.Errorf("write %s: %v", name, err)
		}
		// Shrinking fails and changes nothing.
		if err := f.Truncate(1 << 20); !errors.Is(err, unix.EPERM) {
			t.Errorf("shrinking %s: %v, want EPERM", name, err)
		}
		if st, _ := f.Stat(); st.Size() != 8<<20 {
			t.Errorf("%s is %d bytes after a refused shrink", name, st.Size())
		}
		f.Close()
	}
	if _, err := os.OpenFile(filepath.Join(m.Dir, "vm.raw"), os.O_RDWR|os.O_TRUNC, 0); !errors.Is(err, unix.EPERM) {
		t.Errorf("open with O_TRUNC: %v, want EPERM", err)
	}
	log := m.LogText(t)
	for _, want := range []string{"base.qcow2", "dirty.qcow2", "inuse.qcow2", "invalid.qcow2"} {
		if !strings.Contains(log, "image shown read-only") || harness.CountLines(log, "image shown read-only") < 4 || !strings.Contains(log, want) {
			t.Errorf("the log does not say %s is shown read-only:\n%s", want, log)
		}
	}
	m.Unmount(t)
	for p, want := range before {
		if fileSHA(t, p) != want {
			t.Errorf("%s changed, though it was shown read-only", p)
		}
	}
	qemu.CheckClean(t, img)
	qemu.CheckClean(t, filepath.Join(src, "over.qcow2"))
	qemu.CheckClean(t, filepath.Join(src, "bitmaps.qcow2"))
}

// TestWriteLocks: while a raw file is open for writing, qemu cannot open
// the image at all without -U (qemu's own lock errors), qemu-img info -U
// still can; and while qemu-io has the image open, qcowfs cannot open it
// for writing (EBUSY), though it can for reading only when qemu shares.
func TestWriteLocks(t *testing.T) {
	m, img, raw := mountEmpty(t, harness.Daemon{}, "vm", "8M")
	f := harness.OpenFile(t, raw, os.O_RDWR)
	if _, err := f.WriteAt([]byte("data"), 0); err != nil {
		t.Fatal(err)
	}
	qemu.WantLocked(t, `lock`, "qemu-io", "-f", "qcow2", "-c", "write 0 4k", img)
	qemu.WantLocked(t, `Failed to get shared "write" lock`, "qemu-img", "info", img)
	qemu.Img(t, "info", "-U", img)
	f.Close()

	// The other way round.
	harness.WaitFor(t, "the write locks to go with the last close", 5*1e9, func() bool {
		return exec.Command("qemu-img", "info", img).Run() == nil
	})
	_, release := qemu.HoldOpen(t, img)
	// (An image a qemu writes is not shown, and its name answers EBUSY.)
	if f, err := os.OpenFile(raw, os.O_RDWR, 0); !errors.Is(err, unix.EBUSY) {
		if err == nil {
			f.Close()
		}
		t.Errorf("open for writing while qemu-io has the image: %v, want EBUSY", err)
	}
	release()
	f, err := os.OpenFile(raw, os.O_RDWR, 0)
	if err != nil {
		t.Fatalf("open for writing after qemu let go: %v", err)
	}
	f.Close()
	m.Unmount(t)
	qemu.CheckClean(t, img)
}

// TestOverlapRefused: images whose pointers were aimed at their own tables
// by hand cannot be written through them: the write fails with EIO, the
// corrupt bit is set as qemu would set it, later writes fail too, the table
// is intact byte for byte, and the rest of the disk still reads as before.
// The cases are issue 31's: an L2 entry (COPIED) naming the refcount table
// as its data cluster; one without COPIED naming the L1 table's cluster
// (a write copies the cluster, and used to free and punch the live L1
// table); an L1 entry naming the L1 table's own cluster, and one naming
// the refcount table, as an L2 table (an allocation used to write its L2
// entry there). The whole matrix is qcow2's TestHostileWriteMatrix.
func TestOverlapRefused(t *testing.T) {
	harness.RequireFUSE(t)
	const copied = uint64(1) << 63
	for _, tc := range []struct {
		name   string
		table  uint64 // header field naming the table
		aim    func(t *testing.T, img string, table int64)
		offset int64 // the guest offset written
	}{
		{"L2 entry into the refcount table", qemu.HeaderRefcountTableOffset, func(t *testing.T, img string, table int64) {
			at, entry := qemu.L2EntryOffset(t, img, 0)
			qemu.PatchU(t, img, at, 8, entry&^qemu.OffsetMask|uint64(table))
		}, 0},
		{"L2 entry without COPIED into the L1 table", qemu.HeaderL1TableOffset, func(t *testing.T, img string, table int64) {
			at, _ := qemu.L2EntryOffset(t, img, 0)
			qemu.PatchU(t, img, at, 8, uint64(table))
		}, 0},
		{"L1 entry at the L1 table", qemu.HeaderL1TableOffset, func(t *testing.T, img string, table int64) {
			qemu.PatchU(t, img, table+8, 8, uint64(table)|copied)
		}, 512<<20 + 8000<<16}, // an L2 entry far past the L1 table's 128 bytes, in its cluster
		{"L1 entry at the refcount table", qemu.HeaderRefcountTableOffset, func(t *testing.T, img string, table int64) {
			l1 := int64(qemu.ReadU(t, img, qemu.HeaderL1TableOffset, 8))
			qemu.PatchU(t, img, l1+8, 8, uint64(table)|copied)
		}, 512 << 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := qemu.TempDir(t)
			img := qemu.Make(t, filepath.Join(src, "bad.qcow2"), "1G", "write -P 0x41 0 64k", "write -P 0x42 64k 64k", "write -P 0x43 100M 64k")
			table := int64(qemu.ReadU(t, img, int64(tc.table), 8))
			tc.aim(t, img, table)
			readTable := func() []byte {
				b := make([]byte, 65536)
				f := harness.Open(t, img)
				defer f.Close()
				f.ReadAt(b, table)
				return b
			}
			before := readTable()

			m := harness.Mount(t, src, "--writable", "--log-level=info")
			raw := filepath.Join(m.Dir, "bad.raw")
			f := harness.OpenFile(t, raw, os.O_RDWR|unix.O_DIRECT)
			buf := harness.AlignedBlock(t, 4096)
			for i := range buf {
				buf[i] = 0x5a
			}
			if _, err := f.WriteAt(buf, tc.offset); !errors.Is(err, unix.EIO) {
				t.Errorf("the write through the bad pointer: %v, want EIO", err)
			}
			if _, err := f.WriteAt(buf, 200<<20); !errors.Is(err, unix.EIO) {
				t.Errorf("a later write elsewhere: %v, want EIO (the image is corrupt now)", err)
			}
			// The rest of the disk reads as before.
			got := make([]byte, 64<<10)
			if _, err := f.ReadAt(got[:4096], 100<<20); err != nil || got[0] != 0x43 {
				t.Errorf("guest data at 100 MiB after the refusal: %v, %#x", err, got[0])
			}
			f.Close()
			m.Unmount(t)
			info := qemu.Info(t, img)
			if fs, _ := info["format-specific"].(map[string]any); fs == nil || fs["data"].(map[string]any)["corrupt"] != true {
				t.Errorf("qemu-img info does not say corrupt: %v", info["format-specific"])
			}
			if !bytes.Equal(readTable(), before) {
				t.Error("the table changed")
			}
			if !strings.Contains(m.LogText(t), "would overwrite the image's metadata") {
				t.Errorf("no log line about the overlap:\n%s", m.LogText(t))
			}
		})
	}
}

// TestGrowAcrossTableGrowth: growing a disk whose L1 table must move, at
// the moment its allocation makes the refcount table grow too (issue 31:
// the resize's own header write put the old refcount table back, and
// qemu-img check found 32,000 errors), and in many small steps. Through
// the mount with truncate(1), then qemu-img check and compare against a
// model.
func TestGrowAcrossTableGrowth(t *testing.T) {
	harness.RequireFUSE(t)
	for _, tc := range []struct {
		name  string
		opts  string
		data  int64   // bytes written first (a 512 B image: 8 MiB fills its refcount table)
		grows []int64 // sizes to grow to, in order
	}{
		{"one grow", "cluster_size=512", 122 * 64 << 10, []int64{1 << 30}},
		{"many small grows", "cluster_size=512,refcount_bits=64", 1900 << 10, func() []int64 {
			var s []int64
			for size := int64(4<<20) + 64<<10; size <= 40<<20; size += 1 << 20 {
				s = append(s, size)
			}
			return s
		}()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := t.TempDir()
			img := filepath.Join(src, "grow.qcow2")
			qemu.Create(t, "qcow2", img, "4M", "-o", tc.opts)
			m := harness.Mount(t, src, "--writable")
			raw := filepath.Join(m.Dir, "grow.raw")
			f := harness.OpenFile(t, raw, os.O_RDWR)
			if tc.name == "one grow" {
				f.Truncate(64 << 20)
			}
			model := filepath.Join(t.TempDir(), "model.raw")
			mf, _ := os.Create(model)
			defer mf.Close()
			st, _ := f.Stat()
			mf.Truncate(st.Size())
			buf := make([]byte, 64<<10)
			for off := int64(0); off < tc.data; off += int64(len(buf)) {
				for i := range buf {
					buf[i] = byte(off>>16) ^ byte(i)
				}
				n := min(int64(len(buf)), tc.data-off)
				if _, err := f.WriteAt(buf[:n], off); err != nil {
					t.Fatal(err)
				}
				mf.WriteAt(buf[:n], off)
			}
			if err := f.Sync(); err != nil {
				t.Fatal(err)
			}
			for i, size := range tc.grows {
				if err := f.Truncate(size); err != nil {
					t.Fatalf("grow %d to %d: %v", i, size, err)
				}
				mf.Truncate(size)
				// A write at the new end, through the new L1 table.
				if _, err := f.WriteAt(buf[:512], size-512); err != nil {
					t.Fatal(err)
				}
				mf.WriteAt(buf[:512], size-512)
			}
			f.Close()
			m.Unmount(t)
			qemu.Img(t, "check", img)
			qemu.Img(t, "compare", "-f", "qcow2", "-F", "raw", img, model)
		})
	}
}
