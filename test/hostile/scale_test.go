package hostile

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// forgeSnapshots replaces the snapshot table of image by n entries that
// all use the image's active L1 table (specification, "Snapshots": 40
// fixed bytes, extra data, ID, name, padded to 8), written at the end of
// the file; entry i has ID "i+1" and name "s-(i+1)".
func forgeSnapshots(t *testing.T, image string, n int) {
	t.Helper()
	l1 := qemu.ReadU(t, image, qemu.HeaderL1TableOffset, 8)
	l1Size := qemu.ReadU(t, image, qemu.HeaderL1Size, 4)
	size := qemu.ReadU(t, image, qemu.HeaderSize, 8)
	cs := int64(1) << qemu.ReadU(t, image, qemu.HeaderClusterBits, 4)
	var b bytes.Buffer
	be := binary.BigEndian
	for i := 1; i <= n; i++ {
		id, name := fmt.Sprint(i), fmt.Sprintf("s-%d", i)
		const extra = 24 // vm_state_size_large, disk_size, icount
		e := make([]byte, qemu.SnapshotFixedSize+extra)
		be.PutUint64(e[qemu.SnapshotL1TableOffset:], l1)
		be.PutUint32(e[qemu.SnapshotL1Size:], uint32(l1Size))
		be.PutUint16(e[qemu.SnapshotIDSize:], uint16(len(id)))
		be.PutUint16(e[qemu.SnapshotNameSize:], uint16(len(name)))
		be.PutUint32(e[qemu.SnapshotDateSec:], 1700000000)
		be.PutUint32(e[qemu.SnapshotExtraDataSize:], extra)
		be.PutUint64(e[qemu.SnapshotDiskSize:], size)
		b.Write(e)
		b.WriteString(id)
		b.WriteString(name)
		b.Write(make([]byte, (8-b.Len()%8)%8))
	}
	st, err := os.Stat(image)
	if err != nil {
		t.Fatal(err)
	}
	at := (st.Size() + cs - 1) &^ (cs - 1)
	qemu.WriteAt(t, image, at, b.Bytes())
	qemu.PatchU(t, image, qemu.HeaderNbSnapshots, 4, uint64(n))
	qemu.PatchU(t, image, qemu.HeaderSnapshotsOffset, 8, uint64(at))
}

// statAll lstats every name of dir, like ls -l, within d.
func statAll(t *testing.T, dir string, names []string, d time.Duration) {
	t.Helper()
	harness.Within(t, "stat of every name in "+dir, d, func() (int, error) {
		for _, n := range names {
			var st unix.Stat_t
			if err := unix.Lstat(filepath.Join(dir, n), &st); err != nil {
				return 0, fmt.Errorf("%s: %w", n, err)
			}
		}
		return 0, nil
	})
}

// TestHostileManySnapshots: an image with 65,535 snapshots (the most qemu
// allows) beside a canary. The listing shows all of them, a listing with
// a stat of every name answers, a second one reads a small fraction of
// what the first read (the scan is kept), one snapshot deep in the table
// reads what qemu-img convert -l reads, and the daemon's memory stays
// bounded.
func TestHostileManySnapshots(t *testing.T) {
	harness.RequireFUSE(t)
	src := qemu.TempDir(t)
	img := filepath.Join(src, "many.qcow2")
	qemu.Create(t, "qcow2", img, "16M")
	qemu.IO(t, img, "write -P 0x21 0 1M", "write -P 0x22 8M 64k")
	const n = 65535
	forgeSnapshots(t, img, n)
	if info := qemu.Info(t, img); len(info["snapshots"].([]any)) != n {
		t.Fatalf("qemu-img info lists %d snapshots", len(info["snapshots"].([]any)))
	}
	canary := filepath.Join(src, "canary.qcow2")
	qemu.Create(t, "qcow2", canary, "1M")
	qemu.IO(t, canary, "write -P 0x61 0 1M")

	m := harness.Mount(t, src)
	pid := m.PID(t)
	start := time.Now()
	p0 := harness.ReadProc(t, pid)
	listed := listWithin(t, m.Dir, 120*time.Second)
	statAll(t, m.Dir, listed, 300*time.Second)
	p1 := harness.ReadProc(t, pid)
	t.Logf("listing and stat of %d names: %v, %d MiB read; daemon %v", len(listed), time.Since(start).Round(time.Millisecond), (p1.Rchar-p0.Rchar)>>20, p1)
	if len(listed) != n+2 {
		t.Errorf("%d names listed, want %d (the image, its snapshots, the canary)", len(listed), n+2)
	}
	start = time.Now()
	again := listWithin(t, m.Dir, 120*time.Second)
	statAll(t, m.Dir, again, 300*time.Second)
	p2 := harness.ReadProc(t, pid)
	t.Logf("again: %v, %d KiB read; daemon %v", time.Since(start).Round(time.Millisecond), (p2.Rchar-p1.Rchar)>>10, p2)
	if p2.Rchar-p1.Rchar > (p1.Rchar-p0.Rchar)/2 {
		t.Errorf("the second listing read %d bytes, the first %d: the scan is not kept", p2.Rchar-p1.Rchar, p1.Rchar-p0.Rchar)
	}
	want := filepath.Join(t.TempDir(), "s.raw")
	qemu.Img(t, "convert", "-O", "raw", "-l", "snapshot.name=s-40000", img, want)
	harness.Within(t, "reading a snapshot", 60*time.Second, func() (int, error) {
		harness.SameFile(t, filepath.Join(m.Dir, "many@s-40000.raw"), want)
		return 0, nil
	})
	if b, err := probeImage(t, filepath.Join(m.Dir, "canary.raw")); err != nil || b[0] != 0x61 {
		t.Errorf("the canary: %v", err)
	}
	if p := harness.ReadProc(t, pid); p.HWMKB > harness.MemBound(384) {
		t.Errorf("the daemon peaked at %d MiB", p.HWMKB>>10)
	}
	m.NoPanics(t)
	boundedAll(t, []string{img})
}

// TestHostileManyImages: 2,000 images in a folder. A listing with a stat
// of every name is one scan; the second reads no image again.
func TestHostileManyImages(t *testing.T) {
	harness.RequireFUSE(t)
	src := qemu.TempDir(t)
	dir := filepath.Join(src, "lots")
	os.Mkdir(dir, 0o755)
	tmpl := filepath.Join(t.TempDir(), "t.qcow2")
	qemu.Create(t, "qcow2", tmpl, "1M", "-o", "cluster_size=512")
	qemu.IO(t, tmpl, "write -P 0x31 0 4k")
	copies(t, tmpl, dir, 2000)
	m := harness.Mount(t, src)
	pid := m.PID(t)
	p0 := harness.ReadProc(t, pid)
	start := time.Now()
	listed := listWithin(t, filepath.Join(m.Dir, "lots"), 120*time.Second)
	statAll(t, filepath.Join(m.Dir, "lots"), listed, 120*time.Second)
	p1 := harness.ReadProc(t, pid)
	first := time.Since(start)
	start = time.Now()
	statAll(t, filepath.Join(m.Dir, "lots"), listWithin(t, filepath.Join(m.Dir, "lots"), 120*time.Second), 120*time.Second)
	p2 := harness.ReadProc(t, pid)
	t.Logf("2,000 images: first listing with stats %v, %d KiB read; second %v, %d KiB read", first.Round(time.Millisecond),
		(p1.Rchar-p0.Rchar)>>10, time.Since(start).Round(time.Millisecond), (p2.Rchar-p1.Rchar)>>10)
	if len(listed) != 2000 {
		t.Errorf("%d names listed", len(listed))
	}
	if p2.Rchar-p1.Rchar > (p1.Rchar-p0.Rchar)/4 {
		t.Errorf("the second listing read %d bytes, the first %d", p2.Rchar-p1.Rchar, p1.Rchar-p0.Rchar)
	}
}

// copies writes n copies of file into dir, as img-00000.qcow2, ...
func copies(t testing.TB, file, dir string, n int) {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < n; i++ {
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("img-%05d.qcow2", i)), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// TestHostileBitmapMemory: 400 bitmap directory entries (in use, so qemu
// opens the image without loading them) that all name one table of a
// million entries, the largest qemu allows at 512-byte clusters. The old
// reader read the table and mapped its million clusters once per entry,
// gigabytes; the daemon and qcowfs check stay within bounds.
func TestHostileBitmapMemory(t *testing.T) {
	harness.RequireFUSE(t)
	src := qemu.TempDir(t)
	img := filepath.Join(src, "bitmaps.qcow2")
	qemu.Create(t, "qcow2", img, "64M", "-o", "cluster_size=512")
	qemu.Img(t, "bitmap", "--add", img, "b0")
	qemu.IO(t, img, "write -P 0x41 0 1M")
	n, _, dirOff, ext := qemu.BitmapDirectory(t, img)
	if n != 1 {
		t.Fatalf("%d bitmaps", n)
	}
	// A table of 2^20 entries naming every other cluster of 1 GiB of
	// file (a sparse tail), then a directory of 400 entries naming it.
	st, _ := os.Stat(img)
	tableOff := (st.Size() + 511) &^ 511
	const entries = 1 << 20
	table := make([]byte, 8*entries)
	dataStart := tableOff + int64(len(table))
	for i := range entries {
		binary.BigEndian.PutUint64(table[8*i:], uint64(dataStart+int64(2*i)*512))
	}
	qemu.WriteAt(t, img, tableOff, table)
	entry := make([]byte, 24)
	f, _ := os.Open(img)
	f.ReadAt(entry, dirOff)
	f.Close()
	var d bytes.Buffer
	for i := 0; i < 400; i++ {
		e := append([]byte(nil), entry...)
		binary.BigEndian.PutUint64(e[0:], uint64(tableOff))
		binary.BigEndian.PutUint32(e[8:], entries)
		binary.BigEndian.PutUint32(e[12:], 1|2) // in use, auto
		name := fmt.Sprintf("b%03d", i)
		binary.BigEndian.PutUint16(e[18:], uint16(len(name)))
		d.Write(e)
		d.WriteString(name)
		d.Write(make([]byte, (8-d.Len()%8)%8))
	}
	dirAt := dataStart + 2*entries*512
	qemu.WriteAt(t, img, dirAt, d.Bytes())
	qemu.WriteAt(t, img, dirAt+int64(d.Len()), make([]byte, 512-d.Len()%512))
	qemu.PatchU(t, img, ext, 4, 400)
	qemu.PatchU(t, img, ext+8, 8, uint64(d.Len()))
	qemu.PatchU(t, img, ext+16, 8, uint64(dirAt))
	if out, err := exec.Command("qemu-io", "-r", "-c", "read -P 0x41 0 1M", img).CombinedOutput(); err != nil || bytes.Contains(out, []byte("can't open")) {
		t.Fatalf("qemu-io does not read the image: %v\n%s", err, out)
	}
	canary := filepath.Join(src, "canary.qcow2")
	qemu.Create(t, "qcow2", canary, "1M")
	qemu.IO(t, canary, "write -P 0x61 0 1M")

	m := harness.Mount(t, src)
	pid := m.PID(t)
	listed := listWithin(t, m.Dir, 60*time.Second)
	if !slices.Contains(listed, "bitmaps.raw") {
		t.Errorf("bitmaps.raw is not shown: %q\n%s", listed, m.LogText(t))
	} else if b, err := probeImage(t, filepath.Join(m.Dir, "bitmaps.raw")); err != nil || b[0] != 0x41 {
		t.Errorf("bitmaps.raw: %v", err)
	}
	if b, err := probeImage(t, filepath.Join(m.Dir, "canary.raw")); err != nil || b[0] != 0x61 {
		t.Errorf("the canary: %v", err)
	}
	p := harness.ReadProc(t, pid)
	t.Logf("daemon: %v", p)
	if p.HWMKB > harness.MemBound(256) {
		t.Errorf("the daemon peaked at %d MiB", p.HWMKB>>10)
	}
	m.NoPanics(t)
	boundedAll(t, []string{img})
}

// TestHostileSparseTail: a 512-byte-cluster image whose file is extended
// sparsely to 15 TiB (33 billion clusters). Through the mount it reads and
// seeks like the image before the extension; qcowfs check prints what
// qemu-img check prints for the image before the extension (qemu-img
// check of the extended file fails: it wants 66 GB for its counters),
// qcowfs map what qemu-img map prints, within bounds.
func TestHostileSparseTail(t *testing.T) {
	harness.RequireFUSE(t)
	src := qemu.TempDir(t)
	img := filepath.Join(src, "tail.qcow2")
	qemu.Create(t, "qcow2", img, "64M", "-o", "cluster_size=512")
	qemu.IO(t, img, "write -P 0x51 0 1M", "write -P 0x52 32M 64k", "write -z 40M 64k")
	before := filepath.Join(t.TempDir(), "before.qcow2")
	qemu.Run(t, "cp", img, before)
	wantRaw := qemu.ToRaw(t, before, filepath.Join(t.TempDir(), "before.raw"))
	wantMap := qemu.Map(t, before)
	q := harness.RunCmd(t, exec.Command("qemu-img", "check", "--output=json", before))
	var wantCheck map[string]any
	q.JSON(t, &wantCheck)
	if err := os.Truncate(img, 15<<40); err != nil {
		t.Skipf("cannot extend a file to 15 TiB here: %v", err)
	}
	m := harness.Mount(t, src)
	harness.Within(t, "reading the disk", 60*time.Second, func() (int, error) {
		harness.SameFile(t, filepath.Join(m.Dir, "tail.raw"), wantRaw)
		return 0, nil
	})
	runs := bounded(t, img)
	t.Logf("15 TiB sparse file: info %d MiB %v, map %d MiB %v, check %d MiB %v", runs["info"].rssKB>>10, runs["info"].wall,
		runs["map"].rssKB>>10, runs["map"].wall, runs["check"].rssKB>>10, runs["check"].wall)
	us := harness.RunCmdTimeout(t, exec.Command(harness.Bin(), "check", "--output=json", img), 2*time.Minute)
	var got map[string]any
	us.JSON(t, &got)
	delete(got, "filename")
	delete(wantCheck, "filename")
	if !reflect.DeepEqual(got, wantCheck) || us.Code != q.Code {
		t.Errorf("qcowfs check (exit %d): %v\nqemu-img check before the extension (exit %d): %v", us.Code, got, q.Code, wantCheck)
	}
	mapped := harness.RunCmdTimeout(t, exec.Command(harness.Bin(), "map", "--output=json", img), 2*time.Minute)
	harness.WantOK(t, "qcowfs map --output=json", mapped)
	var gotMap []qemu.MapEntry
	mapped.JSON(t, &gotMap)
	for i := range gotMap {
		if i < len(wantMap) && wantMap[i].Compressed == nil {
			gotMap[i].Compressed = nil
		}
	}
	if !reflect.DeepEqual(gotMap, wantMap) {
		t.Errorf("qcowfs map:\n%s\nqemu-img map before the extension:\n%s", mapped.Stdout, dumpMap(wantMap))
	}
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(m.Dir, "tail.raw"), &st); err != nil || st.Size != 64<<20 {
		t.Errorf("stat: %v, %d bytes", err, st.Size)
	}
	m.NoPanics(t)
}

func dumpMap(m []qemu.MapEntry) string {
	var b strings.Builder
	for _, e := range m {
		j, _ := json.Marshal(e)
		b.Write(j)
		b.WriteByte('\n')
	}
	return b.String()
}
