// Package write tests writable mounts: writes as qemu-io makes them, the
// writeback cache, overlays, guest file systems written through loop
// devices, ENOSPC, torn sectors, a daemon killed mid-write, persistent
// bitmaps kept true through all of it, encrypted images (written as qemu
// writes them, their overlays, named and throwaway, LUKS-encrypted).
package write

// TestMain, and what the writing tests share: an empty image mounted
// writable, and the check of an image against its model once unmounted.

import (
	"path/filepath"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

func TestMain(m *testing.M) { harness.Main(m) }

// mountEmpty makes an empty image name.qcow2 of size in a folder of its
// own and mounts the folder writable by the daemon d; it returns the
// mount, the image and its raw file.
func mountEmpty(t *testing.T, d harness.Daemon, name, size string) (m *harness.Mounted, img, raw string) {
	t.Helper()
	src := harness.SourceDir(t)
	img = filepath.Join(src, name+".qcow2")
	qemu.Create(t, "qcow2", img, size)
	m = d.Mount(t, src, "--writable")
	return m, img, filepath.Join(m.Dir, name+".raw")
}

// checkModel checks img as qemu sees it once no mount has it open:
// qemu-img check finds it clean, and qemu-img convert reads model.
func checkModel(t *testing.T, img string, model []byte) {
	t.Helper()
	qemu.CheckClean(t, img)
	if i := harness.FirstDiff(qemu.RawBytes(t, img), model); i >= 0 {
		t.Errorf("qemu-img convert of %s differs from the model at byte %d", img, i)
	}
}
