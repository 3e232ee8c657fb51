// Package cli tests the command line end to end: mount and unmount, the
// daemon and signals, status, the mount-helper convention (mount -t,
// fstab), flags, -o options, errors and help; info, map and check against
// qemu-img.
package cli

// TestMain, and small helpers of the command line tests: an image, a
// tmpfs, files.

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

func TestMain(m *testing.M) { harness.Main(m) }

// smallImage makes a small image with data, zeros and holes in dir and
// returns its path and what qemu-img convert -O raw makes of it.
func smallImage(t testing.TB, dir, name string) (img, raw string) {
	t.Helper()
	img = filepath.Join(dir, name+".qcow2")
	qemu.Create(t, "qcow2", img, "4M", "-o", "cluster_size=4096")
	qemu.IO(t, img, "write -P 0x5a 0 64k", "write -P 0xa5 1234567 100000", "write -z 2M 64k")
	raw = qemu.ToRaw(t, img, filepath.Join(t.TempDir(), name+".raw"))
	return img, raw
}

// mountTmpfs mounts a tmpfs on dir until the test ends.
func mountTmpfs(t testing.TB, dir string) {
	t.Helper()
	harness.WantOK(t, "mount", harness.Exec(t, "mount", "-t", "tmpfs", "-o", "size=1m", "qcowfs-test", dir))
	t.Cleanup(func() { exec.Command("umount", "-l", dir).Run() })
}

// mkdir makes the folder of the joined parts and returns it.
func mkdir(t testing.TB, parts ...string) string {
	t.Helper()
	d := filepath.Join(parts...)
	if err := os.MkdirAll(d, 0o755); err != nil {
		t.Fatal(err)
	}
	return d
}

// writeFile writes text to path and returns path.
func writeFile(t testing.TB, path, text string) string {
	t.Helper()
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}
