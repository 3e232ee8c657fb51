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
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// allToOne makes an image of l1 L1 entries (512 MiB of disk each, 64 KiB
// clusters) that all name the first span's L2 table, written with cmds,
// and returns it with the data runs of one span, from qemu-img map of an
// image of that one span (the oracle: every span reads the same).
func allToOne(t *testing.T, dir, name string, l1 int64, cmds ...string) (string, [][2]int64) {
	t.Helper()
	one := qemu.Make(t, filepath.Join(t.TempDir(), "one.qcow2"), "512M", cmds...)
	var pattern [][2]int64
	for _, e := range qemu.Map(t, one) {
		if !e.Zero {
			pattern = append(pattern, [2]int64{e.Start, e.Start + e.Length})
		}
	}
	p := filepath.Join(dir, name)
	qemu.Create(t, "qcow2", p, fmt.Sprint(l1<<29))
	qemu.IO(t, p, cmds...)
	l1off := int64(qemu.ReadU(t, p, qemu.HeaderL1TableOffset, 8))
	e := qemu.ReadU(t, p, l1off, 8)
	buf := make([]byte, 8*l1)
	for i := int64(0); i < l1; i++ {
		binary.BigEndian.PutUint64(buf[8*i:], e)
	}
	qemu.WriteAt(t, p, l1off, buf)
	return p, pattern
}

// TestHostileWalks: images whose tables ask for unbounded walks. A 256 TiB
// disk whose 524,288 L1 entries name one L2 table answers lseek anywhere
// like the one table's map, and its st_blocks is counted exactly; a
// 512 TiB one of zero clusters answers SEEK_DATA within its budget (a
// conservative offset, one log line) and stops walking when its caller is
// killed; a snapshot of 2^62 bytes is not shown, the image and its other
// snapshot are. The daemon's memory stays bounded throughout.
func TestHostileWalks(t *testing.T) {
	src := harness.SourceDir(t)
	const l1 = 512 << 10
	_, pattern := allToOne(t, src, "all-to-one.qcow2", l1, "write -P 1 0 64k", "write -P 2 1M 192k", "write -z 2M 64k", "write -c -P 3 8M 64k")
	zeros, _ := allToOne(t, src, "zeros.qcow2", 1<<20, "write -z 0 512M")
	zeros2 := filepath.Join(src, "zeros-killed.qcow2")
	qemu.Run(t, "cp", zeros, zeros2)
	huge := qemu.Make(t, filepath.Join(src, "huge-snapshot.qcow2"), "1M", "write -P 4 0 64k")
	qemu.Img(t, "snapshot", "-c", "huge", huge)
	qemu.Img(t, "snapshot", "-c", "fine", huge)
	qemu.PatchU(t, huge, qemu.SnapshotEntryOffset(t, huge, 0)+qemu.SnapshotDiskSize, 8, 1<<62)
	makeCanary(t, src)

	m := harness.Mount(t, src)
	pid := m.PID(t)
	listed := listWithin(t, m.Dir, 30*time.Second)
	for _, want := range []string{"all-to-one.raw", "zeros.raw", "huge-snapshot.raw", "huge-snapshot@fine.raw", "canary.raw"} {
		if !slices.Contains(listed, want) {
			t.Errorf("%s is not listed: %q", want, listed)
		}
	}
	if slices.Contains(listed, "huge-snapshot@huge.raw") {
		t.Errorf("the snapshot of 2^62 bytes is shown; qemu cannot load it")
	}
	if log := m.LogText(t); !strings.Contains(log, "snapshot not shown") || !strings.Contains(log, "disk_size") {
		t.Errorf("no log line says why the 2^62 snapshot is not shown:\n%s", log)
	}

	// Anywhere on the 256 TiB disk, lseek answers like the one table.
	raw := filepath.Join(m.Dir, "all-to-one.raw")
	start := time.Now()
	for _, span := range []int64{0, 1, 4097, l1 / 2, l1 - 1} {
		base := span << 29
		for _, r := range pattern {
			if d, err := seekAt(t, raw, base+r[0], unix.SEEK_DATA); err != nil || d != base+r[0] {
				t.Errorf("span %d: SEEK_DATA(%d) = %d, %v; want %d", span, base+r[0], d, err, base+r[0])
			}
			if h, err := seekAt(t, raw, base+r[0], unix.SEEK_HOLE); err != nil || h != base+r[1] {
				t.Errorf("span %d: SEEK_HOLE(%d) = %d, %v; want %d", span, base+r[0], h, err, base+r[1])
			}
		}
	}
	t.Logf("%d lseeks on the 256 TiB disk: %v", 10*len(pattern), time.Since(start).Round(time.Millisecond))
	var per int64
	for _, r := range pattern {
		per += r[1] - r[0]
	}
	want := per * l1
	harness.WaitFor(t, "st_blocks of the 256 TiB disk", 120*time.Second, func() bool {
		var st unix.Stat_t
		return unix.Stat(raw, &st) == nil && st.Blocks*512 == want
	})

	// 512 TiB of zero clusters: SEEK_DATA answers within its budget.
	// (Measured once the background data counts are done.)
	waitIdle(t, pid)
	start = time.Now()
	cpu0 := harness.ReadProc(t, pid).CPU
	d, err := seekAt(t, filepath.Join(m.Dir, "zeros.raw"), 0, unix.SEEK_DATA)
	full := harness.ReadProc(t, pid).CPU - cpu0
	t.Logf("SEEK_DATA across 512 TiB of zero clusters: %d, %v after %v (%v of daemon CPU)", d, err, time.Since(start).Round(time.Millisecond), full)
	if err != nil && err != unix.ENXIO {
		t.Errorf("SEEK_DATA on zeros.raw: %v", err)
	}
	if err == nil && !strings.Contains(m.LogText(t), "gave up after its work budget") {
		t.Errorf("a conservative SEEK_DATA answer without a log line")
	}
	// The same walk on another copy, its caller killed at once: the
	// daemon stops walking (FUSE INTERRUPT cancels the request).
	if full > 500*time.Millisecond {
		waitIdle(t, pid)
		h := harness.StartSeeker(t, filepath.Join(m.Dir, "zeros-killed.raw"))
		cpu0 := harness.ReadProc(t, pid).CPU
		time.Sleep(50 * time.Millisecond)
		h.Cmd.Process.Kill()
		h.Cmd.Wait()
		time.Sleep(2 * time.Second)
		killed := harness.ReadProc(t, pid).CPU - cpu0
		t.Logf("the same walk with its caller killed after 50 ms: %v of daemon CPU (uninterrupted: %v)", killed, full)
		if killed > full/2 {
			t.Errorf("the walk went on after its caller was killed: %v of CPU, %v uninterrupted", killed, full)
		}
	} else {
		t.Logf("the walk takes %v: too short to show an interruption", full)
	}
	checkCanary(t, m.Dir)
	peakWithin(t, pid, 160)
	m.NoPanics(t)
	// qemu-img map of the 256 TiB disk prints 2.6 million lines (every
	// span's entries); the bounded runs take one of 32 TiB.
	small, _ := allToOne(t, t.TempDir(), "all-to-one-32T.qcow2", 64<<10, "write -P 1 0 64k", "write -P 2 1M 192k", "write -z 2M 64k", "write -c -P 3 8M 64k")
	boundedAll(t, []string{small, zeros, huge})
}

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

// TestHostileManySnapshots: an image with 65,535 snapshots (the most qemu
// allows) beside a canary. The listing shows all of them, a listing with
// a stat of every name answers, a second one reads a small fraction of
// what the first read (the scan is kept), one snapshot deep in the table
// reads what qemu-img convert -l reads, and the daemon's memory stays
// bounded.
func TestHostileManySnapshots(t *testing.T) {
	src := harness.SourceDir(t)
	img := qemu.Make(t, filepath.Join(src, "many.qcow2"), "16M", "write -P 0x21 0 1M", "write -P 0x22 8M 64k")
	const n = 65535
	forgeSnapshots(t, img, n)
	if info := qemu.Info(t, img); len(info["snapshots"].([]any)) != n {
		t.Fatalf("qemu-img info lists %d snapshots", len(info["snapshots"].([]any)))
	}
	makeCanary(t, src)

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
	sameWithin(t, filepath.Join(m.Dir, "many@s-40000.raw"), want, 60*time.Second)
	checkCanary(t, m.Dir)
	peakWithin(t, pid, 384)
	m.NoPanics(t)
	boundedAll(t, []string{img})
}

// TestHostileBitmapMemory: 400 bitmap directory entries (in use, so qemu
// opens the image without loading them) that all name one table of a
// million entries, the largest qemu allows at 512-byte clusters. The old
// reader read the table and mapped its million clusters once per entry,
// gigabytes; the daemon and qcowfs check stay within bounds.
func TestHostileBitmapMemory(t *testing.T) {
	src := harness.SourceDir(t)
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
	makeCanary(t, src)

	m := harness.Mount(t, src)
	pid := m.PID(t)
	listed := listWithin(t, m.Dir, 60*time.Second)
	if !slices.Contains(listed, "bitmaps.raw") {
		t.Errorf("bitmaps.raw is not shown: %q\n%s", listed, m.LogText(t))
	} else if b, err := probeImage(t, filepath.Join(m.Dir, "bitmaps.raw")); err != nil || b[0] != 0x41 {
		t.Errorf("bitmaps.raw: %v", err)
	}
	checkCanary(t, m.Dir)
	peakWithin(t, pid, 256)
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
	src := harness.SourceDir(t)
	img := filepath.Join(src, "tail.qcow2")
	qemu.Create(t, "qcow2", img, "64M", "-o", "cluster_size=512")
	qemu.IO(t, img, "write -P 0x51 0 1M", "write -P 0x52 32M 64k", "write -z 40M 64k")
	before := filepath.Join(t.TempDir(), "before.qcow2")
	qemu.Run(t, "cp", img, before)
	wantRaw := qemu.ToRaw(t, before, filepath.Join(t.TempDir(), "before.raw"))
	wantMap := qemu.Map(t, before)
	q := harness.Exec(t, "qemu-img", "check", "--output=json", before)
	var wantCheck map[string]any
	q.JSON(t, &wantCheck)
	if err := os.Truncate(img, 15<<40); err != nil {
		t.Skipf("cannot extend a file to 15 TiB here: %v", err)
	}
	m := harness.Mount(t, src)
	sameWithin(t, filepath.Join(m.Dir, "tail.raw"), wantRaw, 60*time.Second)
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
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(m.Dir, "tail.raw"), &st); err != nil || st.Size != 64<<20 {
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
