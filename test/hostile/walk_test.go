package hostile

import (
	"bytes"
	"encoding/binary"
	"fmt"
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

// allToOne makes an image of l1 L1 entries (512 MiB of disk each, 64 KiB
// clusters) that all name the first span's L2 table, written with cmds,
// and returns it with the data runs of one span, from qemu-img map of an
// image of that one span (the oracle: every span reads the same).
func allToOne(t *testing.T, dir, name string, l1 int64, cmds ...string) (string, [][2]int64) {
	t.Helper()
	one := filepath.Join(t.TempDir(), "one.qcow2")
	qemu.Create(t, "qcow2", one, "512M")
	qemu.IO(t, one, cmds...)
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

// seekAt is lseek(SEEK_DATA or SEEK_HOLE) of path at off, within 30 s.
func seekAt(t *testing.T, path string, off int64, whence int) (int64, error) {
	t.Helper()
	return harness.Within(t, fmt.Sprintf("lseek(%s, %d, %d)", filepath.Base(path), off, whence), 30*time.Second, func() (int64, error) {
		fd, err := unix.Open(path, unix.O_RDONLY, 0)
		if err != nil {
			return 0, err
		}
		defer unix.Close(fd)
		return unix.Seek(fd, off, whence)
	})
}

// TestHostileWalks: images whose tables ask for unbounded walks. A 256 TiB
// disk whose 524,288 L1 entries name one L2 table answers lseek anywhere
// like the one table's map, and its st_blocks is counted exactly; a
// 512 TiB one of zero clusters answers SEEK_DATA within its budget (a
// conservative offset, one log line) and stops walking when its caller is
// killed; a snapshot of 2^62 bytes is not shown, the image and its other
// snapshot are. The daemon's memory stays bounded throughout.
func TestHostileWalks(t *testing.T) {
	harness.RequireFUSE(t)
	src := qemu.TempDir(t)
	const l1 = 512 << 10
	_, pattern := allToOne(t, src, "all-to-one.qcow2", l1, "write -P 1 0 64k", "write -P 2 1M 192k", "write -z 2M 64k", "write -c -P 3 8M 64k")
	zeros, _ := allToOne(t, src, "zeros.qcow2", 1<<20, "write -z 0 512M")
	zeros2 := filepath.Join(src, "zeros-killed.qcow2")
	qemu.Run(t, "cp", zeros, zeros2)
	huge := filepath.Join(src, "huge-snapshot.qcow2")
	qemu.Create(t, "qcow2", huge, "1M")
	qemu.IO(t, huge, "write -P 4 0 64k")
	qemu.Img(t, "snapshot", "-c", "huge", huge)
	qemu.Img(t, "snapshot", "-c", "fine", huge)
	qemu.PatchU(t, huge, qemu.SnapshotEntryOffset(t, huge, 0)+qemu.SnapshotDiskSize, 8, 1<<62)
	canary := filepath.Join(src, "canary.qcow2")
	qemu.Create(t, "qcow2", canary, "1M")
	qemu.IO(t, canary, "write -P 0x61 0 1M")

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
		var st syscall.Stat_t
		return syscall.Stat(raw, &st) == nil && st.Blocks*512 == want
	})

	// 512 TiB of zero clusters: SEEK_DATA answers within its budget.
	// (Measured once the background data counts are done.)
	waitIdle(t, pid)
	start = time.Now()
	cpu0 := harness.ReadProc(t, pid).CPU
	d, err := seekAt(t, filepath.Join(m.Dir, "zeros.raw"), 0, unix.SEEK_DATA)
	full := harness.ReadProc(t, pid).CPU - cpu0
	t.Logf("SEEK_DATA across 512 TiB of zero clusters: %d, %v after %v (%v of daemon CPU)", d, err, time.Since(start).Round(time.Millisecond), full)
	if err != nil && err != syscall.ENXIO {
		t.Errorf("SEEK_DATA on zeros.raw: %v", err)
	}
	if err == nil && !strings.Contains(m.LogText(t), "gave up after its work budget") {
		t.Errorf("a conservative SEEK_DATA answer without a log line")
	}
	// The same walk on another copy, its caller killed at once: the
	// daemon stops walking (FUSE INTERRUPT cancels the request).
	if full > 500*time.Millisecond {
		waitIdle(t, pid)
		h := exec.Command(os.Args[0])
		h.Env = append(os.Environ(), helperEnv+"=seek-data:"+filepath.Join(m.Dir, "zeros-killed.raw"))
		var out bytes.Buffer
		h.Stdout = &out
		if err := h.Start(); err != nil {
			t.Fatal(err)
		}
		harness.WaitFor(t, "the helper to open the file", 10*time.Second, func() bool { return strings.Contains(out.String(), "open") })
		cpu0 := harness.ReadProc(t, pid).CPU
		time.Sleep(50 * time.Millisecond)
		h.Process.Kill()
		h.Wait()
		time.Sleep(2 * time.Second)
		killed := harness.ReadProc(t, pid).CPU - cpu0
		t.Logf("the same walk with its caller killed after 50 ms: %v of daemon CPU (uninterrupted: %v)", killed, full)
		if killed > full/2 {
			t.Errorf("the walk went on after its caller was killed: %v of CPU, %v uninterrupted", killed, full)
		}
	} else {
		t.Logf("the walk takes %v: too short to show an interruption", full)
	}
	if b, err := probeImage(t, filepath.Join(m.Dir, "canary.raw")); err != nil || b[0] != 0x61 {
		t.Errorf("the canary: %v", err)
	}
	after := harness.ReadProc(t, pid)
	t.Logf("daemon after the walks: %v", after)
	if after.HWMKB > harness.MemBound(160) {
		t.Errorf("the daemon peaked at %d MiB", after.HWMKB>>10)
	}
	m.NoPanics(t)
	// qemu-img map of the 256 TiB disk prints 2.6 million lines (every
	// span's entries); the bounded runs take one of 32 TiB.
	small, _ := allToOne(t, t.TempDir(), "all-to-one-32T.qcow2", 64<<10, "write -P 1 0 64k", "write -P 2 1M 192k", "write -z 2M 64k", "write -c -P 3 8M 64k")
	boundedAll(t, []string{small, zeros, huge})
}

// waitIdle waits until the daemon uses less than 5% of a CPU over half a
// second: its background work (data counts) is done.
func waitIdle(t *testing.T, pid int) {
	t.Helper()
	harness.WaitFor(t, "the daemon to be idle", 120*time.Second, func() bool {
		c0 := harness.ReadProc(t, pid).CPU
		time.Sleep(500 * time.Millisecond)
		return harness.ReadProc(t, pid).CPU-c0 < 25*time.Millisecond
	})
}
