package hostile

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestHostileBackingInsideMount: an image whose backing file lies inside
// the mount point (the mount's own canary.raw, by its path, or through a
// symlink beside the source), with and without --allow-backing-outside
// naming a folder that holds the mount point. The daemon must not serve
// itself: the image is not shown, the mount says why in its "not shown:"
// line (the request the daemon would have made of its own mount,
// refused: EDEADLK), and the mount answers at once, the canary reading
// back as qemu reads it. Before, opening the backing file was a lookup
// in the mount made while the scan of the same folder held its lock: the
// mount returned after the first scan's 10 s, and every access to it
// hung until the FUSE connection was aborted.
func TestHostileBackingInsideMount(t *testing.T) {
	harness.RequireFUSE(t)
	for _, allow := range []bool{false, true} {
		name := "confined"
		if allow {
			name = "allowed"
		}
		t.Run(name, func(t *testing.T) {
			root := t.TempDir()
			src := filepath.Join(root, "src")
			mnt := filepath.Join(root, "mnt")
			for _, d := range []string{src, mnt} {
				if err := os.Mkdir(d, 0o755); err != nil {
					t.Fatal(err)
				}
			}
			makeCanary(t, src)
			canary := qemu.ToRaw(t, filepath.Join(src, "canary.qcow2"), filepath.Join(t.TempDir(), "canary.raw"))
			qemu.Create(t, "qcow2", filepath.Join(src, "top.qcow2"), "1M", "-u", "-b", filepath.Join(mnt, "canary.raw"), "-F", "raw")
			if err := os.Symlink(mnt, filepath.Join(root, "link")); err != nil {
				t.Fatal(err)
			}
			qemu.Create(t, "qcow2", filepath.Join(src, "viasymlink.qcow2"), "1M", "-u", "-b", "../link/canary.raw", "-F", "raw")
			harness.Cleanup(t, mnt)
			args := []string{"mount", "--log-file", filepath.Join(t.TempDir(), "log")}
			if allow {
				args = append(args, "--allow-backing-outside", root)
			}
			r := harness.Run(t, append(args, src, mnt)...)
			harness.WantOK(t, "qcowfs mount", r)
			names, err := harness.Within(t, "listing the mount", 10*time.Second, func() ([]string, error) {
				return harness.ReadNames(mnt)
			})
			if err != nil || strings.Join(names, " ") != "canary.raw" {
				t.Errorf("the mount shows %v (%v), want only canary.raw", names, err)
			}
			for _, img := range []string{"top.qcow2", "viasymlink.qcow2"} {
				want := "not shown: " + filepath.Join(src, img) + ": backing file"
				if !strings.Contains(r.Stderr, want) || !strings.Contains(r.Stderr, "deadlock") {
					t.Errorf("qcowfs mount did not say %q ... deadlock:\n%s", want, r.Stderr)
				}
			}
			got, err := harness.Within(t, "reading canary.raw", 10*time.Second, func() ([]byte, error) {
				return os.ReadFile(filepath.Join(mnt, "canary.raw"))
			})
			if want, _ := os.ReadFile(canary); err != nil || string(got) != string(want) {
				t.Errorf("canary.raw: %d bytes, %v; want qemu's %d bytes", len(got), err, len(want))
			}
			harness.WantUnmount(t, mnt)
		})
	}
}
