package hostile

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// A patch is one hostile change to a template image: a field set to a
// value at the edge of its range.
type patch struct {
	name string
	tmpl string // template file name
	off  int64
	size int
	val  uint64
}

// edgeValues are the values a field of size bytes is set to: all ones,
// the top bit, and near the top (aligned, so that alignment checks pass
// and the arithmetic after them is what gets tried).
func edgeValues(size int) []uint64 {
	switch size {
	case 8:
		return []uint64{^uint64(0), 0xffffffffffff0000}
	case 4:
		return []uint64{0xffffffff, 0x80000000}
	case 2:
		return []uint64{0xffff}
	}
	return []uint64{0xff}
}

// TestHostileFieldsNearLimits sets every header field, the fields of a
// snapshot table entry, of the bitmaps extension and directory, extension
// lengths, and L1, L2 and refcount table entries to values near 2^64 (or
// the top of their width), one image each, in a folder with a canary. The
// listing answers, the canary reads exactly, the daemon logs no panic,
// every image shown reads what qemu reads or fails with EIO, every image
// not shown has a log line, and qcowfs info, map and check finish on every
// one within bounds of time and memory.
func TestHostileFieldsNearLimits(t *testing.T) {
	harness.RequireFUSE(t)
	src := qemu.TempDir(t)
	tmpl := t.TempDir()

	// The templates: snapshots and bitmaps, and a backing file.
	full := filepath.Join(tmpl, "full.qcow2")
	qemu.Create(t, "qcow2", full, "16M")
	qemu.IO(t, full, "write -P 0x71 0 1M", "write -c -P 0x72 2M 128k")
	qemu.Img(t, "snapshot", "-c", "snap", full)
	qemu.Img(t, "bitmap", "--add", full, "bm")
	qemu.IO(t, full, "write -P 0x73 512k 1M", "write -z 4M 64k")
	base := filepath.Join(src, "base.raw.img")
	qemu.Create(t, "raw", base, "16M")
	qemu.Run(t, "sh", "-c", "printf 'BASEBASE' | dd of="+base+" conv=notrunc status=none")
	backed := filepath.Join(tmpl, "backed.qcow2")
	qemu.Create(t, "qcow2", backed, "16M", "-b", base, "-F", "raw")
	qemu.IO(t, backed, "write -P 0x74 1M 64k")

	var patches []patch
	add := func(name, tmplName string, off int64, size int) {
		for _, v := range edgeValues(size) {
			patches = append(patches, patch{fmt.Sprintf("%s-%x", name, v), tmplName, off, size, v})
		}
	}
	for _, f := range []struct {
		name string
		off  int64
		size int
	}{
		{"backing_file_offset", qemu.HeaderBackingFileOffset, 8}, {"backing_file_size", qemu.HeaderBackingFileSize, 4},
		{"cluster_bits", qemu.HeaderClusterBits, 4}, {"size", qemu.HeaderSize, 8}, {"crypt_method", qemu.HeaderCryptMethod, 4},
		{"l1_size", qemu.HeaderL1Size, 4}, {"l1_table_offset", qemu.HeaderL1TableOffset, 8},
		{"refcount_table_offset", qemu.HeaderRefcountTableOffset, 8}, {"refcount_table_clusters", qemu.HeaderRefcountTableClusters, 4},
		{"nb_snapshots", qemu.HeaderNbSnapshots, 4}, {"snapshots_offset", qemu.HeaderSnapshotsOffset, 8},
		{"incompatible_features", qemu.HeaderIncompatibleFeatures, 8}, {"compatible_features", qemu.HeaderCompatibleFeatures, 8},
		{"autoclear_features", qemu.HeaderAutoclearFeatures, 8}, {"refcount_order", qemu.HeaderRefcountOrder, 4},
		{"header_length", qemu.HeaderHeaderLength, 4},
	} {
		add("hdr-"+f.name, "full.qcow2", f.off, f.size)
		if f.name == "backing_file_offset" || f.name == "backing_file_size" {
			add("hdr-backed-"+f.name, "backed.qcow2", f.off, f.size)
		}
	}
	sn := qemu.SnapshotEntryOffset(t, full, 0)
	for _, f := range []struct {
		name string
		off  int64
		size int
	}{
		{"l1_table_offset", 0, 8}, {"l1_size", 8, 4}, {"id_str_size", 12, 2}, {"name_size", 14, 2},
		{"extra_data_size", 36, 4}, {"vm_state_size_large", 40, 8}, {"disk_size", 48, 8},
	} {
		add("snap-"+f.name, "full.qcow2", sn+f.off, f.size)
	}
	_, _, dir, ext := qemu.BitmapDirectory(t, full)
	for _, f := range []struct {
		name string
		off  int64
		size int
	}{
		{"nb_bitmaps", ext, 4}, {"directory_size", ext + 8, 8}, {"directory_offset", ext + 16, 8},
		{"table_offset", dir, 8}, {"table_size", dir + 8, 4}, {"granularity", dir + 17, 1},
		{"name_size", dir + 18, 2}, {"extra_data_size", dir + 20, 4},
	} {
		add("bitmap-"+f.name, "full.qcow2", f.off, f.size)
	}
	hl := int64(qemu.ReadU(t, full, qemu.HeaderHeaderLength, 4))
	add("ext-length", "full.qcow2", hl+4, 4)
	l1 := int64(qemu.ReadU(t, full, qemu.HeaderL1TableOffset, 8))
	add("l1-entry", "full.qcow2", l1, 8)
	rt := int64(qemu.ReadU(t, full, qemu.HeaderRefcountTableOffset, 8))
	add("reftable-entry", "full.qcow2", rt, 8)
	l2at, _ := qemu.L2EntryOffset(t, full, 0)
	add("l2-entry", "full.qcow2", l2at, 8)
	cat, _ := qemu.L2EntryOffset(t, full, 32) // the compressed cluster at 2 MiB
	patches = append(patches, patch{"l2-compressed-max", "full.qcow2", cat, 8, 1<<62 | (1<<62 - 1)})

	var hostile []string
	for _, p := range patches {
		dst := filepath.Join(src, p.name+".qcow2")
		qemu.Run(t, "cp", filepath.Join(tmpl, p.tmpl), dst)
		qemu.PatchU(t, dst, p.off, p.size, p.val)
		hostile = append(hostile, dst)
	}
	good := filepath.Join(src, "good.qcow2")
	qemu.Create(t, "qcow2", good, "4M")
	qemu.IO(t, good, "write -P 0x61 0 1M", "write -P 0x62 3M 64k")
	goodRaw := qemu.ToRaw(t, good, filepath.Join(t.TempDir(), "good.raw"))

	m := harness.Mount(t, src)
	pid := m.PID(t)
	before := harness.ReadProc(t, pid)
	start := time.Now()
	listed := listWithin(t, m.Dir, 120*time.Second)
	t.Logf("listing %d hostile images and a canary: %v", len(hostile), time.Since(start).Round(time.Millisecond))
	if !slices.Contains(listed, "good.raw") {
		t.Fatalf("the canary is not listed: %q", listed)
	}
	harness.Within(t, "reading the canary", 30*time.Second, func() (int, error) {
		harness.SameFile(t, filepath.Join(m.Dir, "good.raw"), goodRaw)
		return 0, nil
	})
	log := m.LogText(t)
	shown, compared := 0, 0
	for _, p := range hostile {
		raw := strings.TrimSuffix(filepath.Base(p), ".qcow2") + ".raw"
		if !slices.Contains(listed, raw) {
			if !strings.Contains(log, "image="+p) {
				t.Errorf("%s is not shown and no log line says why", filepath.Base(p))
			}
			continue
		}
		shown++
		got, err := probeImage(t, filepath.Join(m.Dir, raw))
		if err != nil {
			if !errIs(err, syscall.EIO) {
				t.Errorf("%s: %v, want data or EIO", raw, err)
			}
			continue
		}
		if want, ok := qemuConvert(t, p); ok {
			compared++
			if !bytes.Equal(got, want) {
				t.Errorf("%s: the bytes served differ from qemu-img convert's", raw)
			}
		}
	}
	t.Logf("%d hostile images: %d shown (%d compared with qemu-img convert), %d refused", len(hostile), shown, compared, len(hostile)-shown)
	m.NoPanics(t)
	// Once its background counts are done, the daemon holds no image.
	harness.WaitFor(t, "the daemon to close every image", 60*time.Second, func() bool { return harness.ReadProc(t, pid).Files <= before.Files })
	t.Logf("daemon before: %v; after: %v", before, harness.ReadProc(t, pid))
	boundedAll(t, hostile)
}

// probeImage reads a served disk of at most 64 MiB whole (more: its first
// 4 MiB), and asks lseek where its data is, within timeouts; it returns
// the bytes read.
func probeImage(t testing.TB, path string) ([]byte, error) {
	t.Helper()
	return harness.Within(t, "probing "+path, 60*time.Second, func() ([]byte, error) {
		f, err := os.Open(path)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		st, err := f.Stat()
		if err != nil {
			return nil, err
		}
		for _, whence := range []int{unix.SEEK_DATA, unix.SEEK_HOLE} {
			if _, err := unix.Seek(int(f.Fd()), 0, whence); err != nil && err != syscall.ENXIO {
				return nil, err
			}
		}
		n := min(st.Size(), 64<<20)
		if st.Size() > 64<<20 {
			n = 4 << 20
		}
		b := make([]byte, n)
		if k, err := f.ReadAt(b, 0); err != nil && !(err == io.EOF && int64(k) == n) {
			return nil, err
		}
		if st.Size() > 64<<20 {
			return nil, nil // not compared
		}
		return b, nil
	})
}

// qemuConvert returns what qemu-img convert makes of image (at most 64 MiB
// of it), or false if qemu cannot read it.
func qemuConvert(t testing.TB, image string) ([]byte, bool) {
	t.Helper()
	out := filepath.Join(t.TempDir(), "q.raw")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	info, err := exec.CommandContext(ctx, "qemu-img", "info", "--output=json", image).Output()
	if err != nil || !bytes.Contains(info, []byte(`"virtual-size"`)) {
		return nil, false
	}
	var size int64
	if i := bytes.Index(info, []byte(`"virtual-size": `)); i >= 0 {
		fmt.Sscanf(string(info[i+len(`"virtual-size": `):]), "%d", &size)
	}
	if size > 64<<20 {
		return nil, false
	}
	if err := exec.CommandContext(ctx, "qemu-img", "convert", "-O", "raw", image, out).Run(); err != nil {
		return nil, false
	}
	b, err := os.ReadFile(out)
	return b, err == nil
}
