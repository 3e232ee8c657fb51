package hostile

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestHostileAgreeWithQemu: where qemu decides what an odd image means,
// the mount agrees. A size field of 1 MiB + 123 is a disk of 1 MiB
// (qemu-img info, qemu-img convert); a snapshot whose disk size is not a
// whole number of sectors cannot be applied by qemu, and is not shown;
// two snapshots with the same ID are each served with their own content
// (qemu-img convert -l snapshot.name=).
func TestHostileAgreeWithQemu(t *testing.T) {
	harness.RequireFUSE(t)
	src := qemu.TempDir(t)
	odd := filepath.Join(src, "odd.qcow2")
	qemu.Create(t, "qcow2", odd, "2M")
	qemu.IO(t, odd, "write -P 0x41 0 2M")
	qemu.PatchU(t, odd, qemu.HeaderSize, 8, 1<<20+123)

	snaps := filepath.Join(src, "snaps.qcow2")
	qemu.Create(t, "qcow2", snaps, "1M")
	qemu.IO(t, snaps, "write -P 0x51 0 64k")
	qemu.Img(t, "snapshot", "-c", "first", snaps)
	qemu.IO(t, snaps, "write -P 0x52 0 64k")
	qemu.Img(t, "snapshot", "-c", "second", snaps)
	qemu.IO(t, snaps, "write -P 0x53 0 64k")
	qemu.Img(t, "snapshot", "-c", "oddsize", snaps)
	// The second takes the first's ID ("1", same length as "2").
	qemu.PatchU(t, snaps, qemu.SnapshotEntryOffset(t, snaps, 1)+64, 1, '1')
	qemu.PatchU(t, snaps, qemu.SnapshotEntryOffset(t, snaps, 2)+qemu.SnapshotDiskSize, 8, 1<<20+512+100)
	cp := filepath.Join(t.TempDir(), "apply.qcow2")
	qemu.Run(t, "cp", snaps, cp)
	if err := exec.Command("qemu-img", "snapshot", "-a", "oddsize", cp).Run(); err == nil {
		t.Fatal("qemu-img applies the snapshot of odd size; the case expects it refused")
	}
	ids := []string{}
	for _, s := range qemu.Info(t, snaps)["snapshots"].([]any) {
		ids = append(ids, s.(map[string]any)["id"].(string))
	}
	if !slices.Equal(ids, []string{"1", "1", "3"}) {
		t.Fatalf("qemu-img info lists IDs %q", ids)
	}

	m := harness.Mount(t, src)
	listed := listWithin(t, m.Dir, 20*time.Second)
	want := qemu.Info(t, odd)["virtual-size"].(float64)
	st, err := os.Stat(filepath.Join(m.Dir, "odd.raw"))
	if err != nil || float64(st.Size()) != want {
		t.Errorf("odd.raw: %v, size %d; qemu-img info says %v", err, st.Size(), want)
	}
	harness.Within(t, "reading odd.raw", 20*time.Second, func() (int, error) {
		harness.SameFile(t, filepath.Join(m.Dir, "odd.raw"), qemu.ToRaw(t, odd, filepath.Join(t.TempDir(), "odd.raw")))
		return 0, nil
	})
	for _, name := range []string{"first", "second"} {
		raw := "snaps@" + name + ".raw"
		if !slices.Contains(listed, raw) {
			t.Errorf("%s is not listed: %q", raw, listed)
			continue
		}
		want := filepath.Join(t.TempDir(), name+".raw")
		qemu.Img(t, "convert", "-O", "raw", "-l", "snapshot.name="+name, snaps, want)
		harness.Within(t, "reading "+raw, 20*time.Second, func() (int, error) {
			harness.SameFile(t, filepath.Join(m.Dir, raw), want)
			return 0, nil
		})
	}
	for _, name := range listed {
		if strings.Contains(name, "oddsize") {
			t.Errorf("%s is shown; qemu cannot apply that snapshot", name)
		}
	}
	if log := m.LogText(t); !strings.Contains(log, "snapshot not shown") || !strings.Contains(log, "multiple of 512") {
		t.Errorf("no line says why the snapshot of odd size is not shown:\n%s", log)
	}
	m.NoPanics(t)
	boundedAll(t, []string{odd, snaps})
}
