package cli

// Command line tests: mount flags and -o options on real mounts: the
// options other FUSE file systems use, relative paths, a folder with a
// comma, a single image that is refused.

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestMountOptionsAccepted: the generic and sshfs-style options qcowfs
// understands mount, and fsname= names the source.
func TestMountOptionsAccepted(t *testing.T) {
	harness.RequireFUSE(t)
	src := t.TempDir()
	_, raw := smallImage(t, src, "vm")
	mnt := t.TempDir()
	harness.Cleanup(t, mnt)
	r := harness.Run(t, "mount", "--log-file", filepath.Join(t.TempDir(), "log"),
		"-o", "defaults,noatime,nonempty,kernel_cache,default_permissions,subtype=qcowfs,fsname=my-images,x-systemd.automount,_netdev", src, mnt)
	harness.WantOK(t, "qcowfs mount -o ...", r)
	m := harness.MountAt(t, mnt)
	if m == nil || m.FSType != "fuse.qcowfs" || m.Source != "my-images" {
		t.Fatalf("mounted as %+v, want fuse.qcowfs with source my-images", m)
	}
	harness.SameFile(t, filepath.Join(mnt, "vm.raw"), raw)
	harness.WantOK(t, "qcowfs unmount", harness.Run(t, "unmount", mnt))
	harness.WaitGone(t, mnt)
}

// chainOutside makes an overlay in src whose backing file lies in
// outside (a folder of its own), and returns the overlay and its bytes.
func chainOutside(t *testing.T, src, outside string) (over, raw string) {
	t.Helper()
	base := filepath.Join(outside, "base.qcow2")
	qemu.Create(t, "qcow2", base, "2M")
	qemu.IO(t, base, "write -P 0x3c 0 1M")
	over = filepath.Join(src, "over.qcow2")
	qemu.Create(t, "qcow2", over, "2M", "-b", base, "-F", "qcow2")
	qemu.IO(t, over, "write -P 0x4d 512k 64k")
	return over, qemu.ToRaw(t, over, filepath.Join(t.TempDir(), "over.raw"))
}

// TestMountRelativePaths: relative paths in flags and options are the
// caller's, not the daemon's (which works from /): the backing folder, the
// log file and the CPU profile.
func TestMountRelativePaths(t *testing.T) {
	harness.RequireFUSE(t)
	work := t.TempDir()
	src := mkdir(t, work, "images")
	mkdir(t, work, "backing")
	_, raw := chainOutside(t, src, filepath.Join(work, "backing"))
	for _, args := range [][]string{
		{"mount", "--allow-backing-outside=backing", "--log-file=q.log", "--cpu-profile=cpu.prof", "images", "mnt1"},
		{"mount", "-o", "allow_backing_outside=backing,log_file=q2.log,cpu_profile=cpu2.prof", "images", "mnt2"},
		{"images", "mnt3", "-o", "allow_backing_outside=./backing,log_file=q3.log"},
	} {
		mnt := mkdir(t, work, args[len(args)-1])
		if args[0] != "mount" {
			mnt = mkdir(t, work, args[1])
		}
		harness.Cleanup(t, mnt)
		cmd := exec.Command(harness.Bin(), args...)
		cmd.Dir = work
		harness.WantOK(t, "qcowfs "+strings.Join(args, " "), harness.RunCmd(t, cmd))
		harness.SameFile(t, filepath.Join(mnt, "over.raw"), raw)
		harness.WantOK(t, "qcowfs unmount", harness.Run(t, "unmount", mnt))
		harness.WaitGone(t, mnt)
		for _, a := range args {
			for _, kv := range strings.Split(a, ",") {
				for _, key := range []string{"log-file=", "log_file=", "cpu-profile=", "cpu_profile="} {
					if _, name, ok := strings.Cut(kv, key); ok {
						st, err := os.Stat(filepath.Join(work, name))
						if err != nil || st.Size() == 0 {
							t.Errorf("qcowfs %s: %s in the caller's folder: %v (size %v)", strings.Join(args, " "), name, err, st)
						}
					}
				}
			}
		}
	}
}

// TestAllowBackingOutsideComma: a folder whose name has a comma is one
// folder, as a repeated flag and as a quoted option.
func TestAllowBackingOutsideComma(t *testing.T) {
	harness.RequireFUSE(t)
	src := t.TempDir()
	outside := mkdir(t, t.TempDir(), "a,b")
	_, raw := chainOutside(t, src, outside)
	other := t.TempDir()
	for _, args := range [][]string{
		{"--allow-backing-outside=" + other, "--allow-backing-outside=" + outside},
		{"-o", `allow_backing_outside="` + outside + `"`},
	} {
		mnt := t.TempDir()
		harness.Cleanup(t, mnt)
		all := append(append([]string{"mount", "--log-file", filepath.Join(t.TempDir(), "log")}, args...), src, mnt)
		harness.WantOK(t, "qcowfs "+strings.Join(all, " "), harness.Run(t, all...))
		harness.SameFile(t, filepath.Join(mnt, "over.raw"), raw)
		harness.WantOK(t, "qcowfs unmount", harness.Run(t, "unmount", mnt))
		harness.WaitGone(t, mnt)
	}
}

// TestMountSingleImageRefused: a single image the mount would not show
// fails the mount with the reason and the flag that lifts it; nothing is
// mounted, no daemon stays. With that flag it mounts.
func TestMountSingleImageRefused(t *testing.T) {
	harness.RequireFUSE(t)
	src := t.TempDir()
	outside := t.TempDir()
	over, raw := chainOutside(t, src, outside)
	corrupt := filepath.Join(src, "corrupt.qcow2")
	qemu.Create(t, "qcow2", corrupt, "1M")
	qemu.SetIncompatible(t, corrupt, 2)
	locked, _ := smallImage(t, src, "locked")
	qemu.HoldOpen(t, locked)
	for _, c := range []struct {
		img, hint string
		fix       []string
	}{
		{over, "--allow-backing-outside=" + outside, []string{"--allow-backing-outside", outside}},
		{corrupt, "--allow-corrupt", []string{"--allow-corrupt"}},
		{locked, "--force-share", []string{"--force-share"}},
	} {
		mnt := t.TempDir()
		harness.Cleanup(t, mnt)
		r := harness.Run(t, "mount", c.img, mnt)
		harness.WantError(t, "qcowfs mount "+c.img, r, c.img, c.hint)
		if r.Code != 1 {
			t.Errorf("exit status %d, want 1", r.Code)
		}
		if m := harness.MountAt(t, mnt); m != nil {
			t.Errorf("the refused image %s is mounted: %+v", c.img, m)
		}
		if p := harness.Daemons(t, mnt); len(p) != 0 {
			t.Errorf("qcowfs processes left: %v", p)
		}
		args := append(append([]string{"mount", "--log-file", filepath.Join(t.TempDir(), "log")}, c.fix...), c.img, mnt)
		harness.WantOK(t, "qcowfs "+strings.Join(args, " "), harness.Run(t, args...))
		if c.img == over {
			harness.SameFile(t, filepath.Join(mnt, "over.raw"), raw)
		}
		harness.WantOK(t, "qcowfs unmount", harness.Run(t, "unmount", mnt))
		harness.WaitGone(t, mnt)
	}
}
