package read

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestSnapshotFiles: each internal snapshot appears next to its image as
// STEM@NAME.raw (escaped), with the snapshot's own virtual size and
// bytes; the oracle is a copy of the image reverted to the snapshot with
// qemu-img snapshot -a.
func TestSnapshotFiles(t *testing.T) {
	harness.RequireFUSE(t)
	src := qemu.TempDir(t)
	vm := filepath.Join(src, "vm.qcow2")
	qemu.Create(t, "qcow2", vm, "8M")
	qemu.IO(t, vm, "write -P 0x81 0 1M", "write -P 0x82 5M 64k")
	qemu.Img(t, "snapshot", "-c", "first", vm)
	qemu.IO(t, vm, "write -P 0x83 512k 1M", "write -z 5M 4k")
	qemu.Img(t, "resize", "-q", vm, "12M")
	qemu.Img(t, "snapshot", "-c", "two/with slash", vm)
	qemu.IO(t, vm, "write -P 0x84 10M 100k")
	m := harness.Mount(t, src)

	want := []string{"vm.raw", "vm@first.raw", "vm@two%2Fwith slash.raw"}
	if got := harness.Names(t, m.Dir); !slices.Equal(got, want) {
		t.Fatalf("lists %q, want %q", got, want)
	}
	tmp := t.TempDir()
	for id, file := range map[string]string{"1": "vm@first.raw", "2": "vm@two%2Fwith slash.raw"} {
		cp := filepath.Join(tmp, id+".qcow2")
		qemu.Run(t, "cp", vm, cp)
		qemu.Img(t, "snapshot", "-a", id, cp)
		raw := qemu.ToRaw(t, cp, filepath.Join(tmp, id+".raw"))
		harness.SameFile(t, filepath.Join(m.Dir, file), raw)
	}
	harness.SameFile(t, filepath.Join(m.Dir, "vm.raw"), qemu.ToRaw(t, vm, filepath.Join(tmp, "vm.raw")))
	st, err := os.Stat(filepath.Join(m.Dir, "vm@first.raw"))
	if err != nil {
		t.Fatal(err)
	}
	if st.Size() != 8<<20 {
		t.Errorf("vm@first.raw is %d bytes; the snapshot was taken at 8 MiB", st.Size())
	}
}
