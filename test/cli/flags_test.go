package cli

// Command line tests: mount flags and -o options on real mounts (the
// options other FUSE file systems use, relative paths, a folder with a
// comma, a single image that is refused); user mistakes, each one line on
// stderr and nothing mounted.

import (
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

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
	harness.WantUnmount(t, mnt)
}

// chainOutside makes an overlay in src whose backing file lies in
// outside (a folder of its own), and returns the overlay and its bytes.
func chainOutside(t *testing.T, src, outside string) (over, raw string) {
	t.Helper()
	base := qemu.Make(t, filepath.Join(outside, "base.qcow2"), "2M", "write -P 0x3c 0 1M")
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
		harness.WantUnmount(t, mnt)
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
		harness.WantUnmount(t, mnt)
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
		harness.WantUnmount(t, mnt)
	}
}

// TestMountSingleImageOverlayRefused: a single image whose overlay the
// mount refuses (the original grown past it since it was made) fails the
// mount as any single image that would not be shown does: non-zero, the
// reason in one line, nothing mounted, no daemon, in the background and in
// the foreground. Before, it mounted an empty folder with exit status 0.
// Without --overlay the image mounts (its grown size, as qemu-img info says).
func TestMountSingleImageOverlayRefused(t *testing.T) {
	harness.RequireFUSE(t)
	src := t.TempDir()
	img, _ := smallImage(t, src, "vm")
	ov := t.TempDir()
	m := harness.Mount(t, img, "--writable", "--overlay", ov)
	harness.WantOK(t, "dd", harness.Exec(t, "dd", "if=/dev/zero", "of="+filepath.Join(m.Dir, "vm.raw"), "bs=4k", "count=1", "conv=notrunc,fsync", "status=none"))
	harness.WantUnmount(t, m.Dir)
	overlay := filepath.Join(ov, "vm.qcow2")
	qemu.Img(t, "resize", img, "8M")
	for _, fg := range []bool{false, true} {
		mnt := t.TempDir()
		harness.Cleanup(t, mnt)
		args := []string{"mount", "--log-file", filepath.Join(t.TempDir(), "log"), "--writable", "--overlay", ov, img, mnt}
		if fg {
			args = append(args[:1], append([]string{"--foreground"}, args[1:]...)...)
		}
		r := harness.Run(t, args...)
		harness.WantError(t, "qcowfs "+strings.Join(args, " "), r, overlay, img, "smaller")
		if m := harness.MountAt(t, mnt); m != nil {
			t.Errorf("mounted: %+v", m)
		}
		if p := harness.Daemons(t, mnt); len(p) != 0 {
			t.Errorf("qcowfs processes left: %v", p)
		}
	}
	m = harness.Mount(t, img)
	if st, err := os.Stat(filepath.Join(m.Dir, "vm.raw")); err != nil || st.Size() != int64(qemu.Info(t, img)["virtual-size"].(float64)) {
		t.Errorf("vm.raw without the overlay: %v, %v; want qemu-img info's virtual size", st, err)
	}
}

// TestCLIErrors: every user mistake is one line on stderr, a non-zero
// exit, no mount and no daemon.
func TestCLIErrors(t *testing.T) {
	harness.RequireFUSE(t)
	root := t.TempDir()
	src := mkdir(t, root, "images")
	smallImage(t, src, "vm")
	notImage := writeFile(t, filepath.Join(root, "notimage.qcow2"), strings.Repeat("not a qcow2 image\n", 1000))
	regular := writeFile(t, filepath.Join(root, "file"), "a regular file\n")
	mnt := mkdir(t, root, "mnt")
	inside := mkdir(t, src, "sub")
	tmpfs := mkdir(t, root, "tmpfs")
	mountTmpfs(t, tmpfs)
	qcowMnt := harness.Mount(t, src).Dir
	// A source inside the mount point: the mount would hide it from the
	// daemon itself.
	outer := mkdir(t, root, "outer")
	hiddenSrc := mkdir(t, outer, "images")
	smallImage(t, hiddenSrc, "hidden")

	cases := []struct {
		name  string
		args  []string
		mnt   string
		words []string
	}{
		{"SRC missing", []string{"mount", filepath.Join(root, "nosuch"), mnt}, mnt, []string{"nosuch"}},
		{"SRC missing foreground", []string{"mount", "--foreground", filepath.Join(root, "nosuch"), mnt}, mnt, []string{"nosuch"}},
		{"MNT missing", []string{"mount", src, filepath.Join(root, "nomnt")}, filepath.Join(root, "nomnt"), []string{"nomnt"}},
		{"MNT regular file", []string{"mount", src, regular}, regular, []string{regular, "not a folder"}},
		{"MNT tmpfs mount", []string{"mount", src, tmpfs}, tmpfs, []string{"already a mount point"}},
		{"MNT qcowfs mount", []string{"mount", src, qcowMnt}, qcowMnt, []string{"already a mount point"}},
		{"MNT inside SRC", []string{"mount", src, inside}, inside, []string{"inside"}},
		{"MNT is SRC", []string{"mount", src, src}, src, []string{"inside"}},
		{"SRC inside MNT", []string{"mount", hiddenSrc, outer}, outer, []string{"inside"}},
		{"SRC is /", []string{"mount", "/", mnt}, mnt, []string{"inside the source folder /"}},
		{"SRC is an ancestor of MNT", []string{"mount", root, mnt}, mnt, []string{"inside the source folder " + root}},
		{"SRC is an ancestor, relative", []string{"mount", "..", "."}, mnt, []string{"inside the source folder"}},
		{"SRC not qcow2", []string{"mount", notImage, mnt}, mnt, []string{notImage, "not a qcow2 image"}},
		{"unknown option", []string{"mount", "-o", "ro,bogus", src, mnt}, mnt, []string{"bogus"}},
		{"unknown option helper", []string{src, mnt, "-o", "ro,allow_other,bogus"}, mnt, []string{"bogus"}},
		{"bad option value", []string{"mount", "-o", "l2_cache_size=lots", src, mnt}, mnt, []string{"l2_cache_size"}},
		// Found by the daemon, after the checks of the waiting parent:
		// its reason must still reach the user.
		{"log file unwritable", []string{"mount", "--log-file", filepath.Join(root, "nodir", "x.log"), src, mnt}, mnt, []string{"log file", "nodir"}},
	}
	for _, c := range cases {
		t.Run(strings.ReplaceAll(c.name, " ", "_"), func(t *testing.T) {
			harness.Cleanup(t, c.mnt)
			mountsBefore := harness.MountsUnder(t, root)
			daemonsBefore := harness.Daemons(t, c.mnt)
			// Errors are found before anything is mounted: quickly.
			cmd := exec.Command(harness.Bin(), c.args...)
			if strings.HasSuffix(c.name, "relative") {
				cmd.Dir = c.mnt
			}
			r := harness.RunCmdTimeout(t, cmd, 20*time.Second)
			harness.WantError(t, "qcowfs "+strings.Join(c.args, " "), r, c.words...)
			if after := harness.MountsUnder(t, root); !reflect.DeepEqual(after, mountsBefore) {
				t.Errorf("mounts under %s changed:\nbefore %v\nafter  %v", root, mountsBefore, after)
			}
			if after := harness.Daemons(t, c.mnt); !reflect.DeepEqual(after, daemonsBefore) {
				t.Errorf("qcowfs processes for %s: before %v, after %v", c.mnt, daemonsBefore, after)
			}
		})
	}

	// Usage mistakes: one line naming the mistake and the --help to
	// read, exit status 2, nothing mounted, no daemon.
	for _, c := range []struct {
		args  []string
		words []string
	}{
		{[]string{"mount", src}, []string{`expected "<mountpoint>"`, "qcowfs mount --help"}},
		{[]string{"mount", "--cache-size=12Q", src, mnt}, []string{"--cache-size", `"12Q"`, "qcowfs mount --help"}},
		{[]string{"mount", "-o", "cache_size=12Q", src, mnt}, []string{"-o cache_size", `"12Q"`}},
		{[]string{"mount", "--no-such-flag", src, mnt}, []string{"--no-such-flag", "--help"}},
		{[]string{"mount", "--log-level", "loud", src, mnt}, []string{"loud", "--help"}},
		{[]string{"mount", "-o", "ro,bogus", src, mnt}, []string{`unknown mount option "bogus"`}},
		{[]string{src, mnt, "-o", "ro,allow_other,bogus"}, []string{"bogus"}},
		{[]string{"mount", "-o", "l2_cache_size=lots", src, mnt}, []string{"l2_cache_size"}},
		{[]string{"mount", "-o", "allow_other=yes", src, mnt}, []string{"allow_other takes no value"}},
		{[]string{"info"}, []string{`expected "<image>"`, "qcowfs info --help"}},
		{[]string{"inof", "x.qcow2"}, []string{`unknown command "inof"`, `did you mean "info"?`}},
		{[]string{"chek", "a", "b"}, []string{`unknown command "chek"`, `did you mean "check"?`}},
		{[]string{"mout", src, mnt}, []string{`unknown command "mout"`, `did you mean "mount"?`}},
		{[]string{"frobnicate"}, []string{`unknown command "frobnicate"`, "commands:"}},
		{[]string{"help", "mout"}, []string{`unknown command "mout"`}},
		// Options of other FUSE file systems, refused one by one
		// with the reason.
		{[]string{"mount", "-o", "allow_root", src, mnt}, []string{"allow_root", "allow_other"}},
		{[]string{"mount", "-o", "auto_unmount", src, mnt}, []string{"auto_unmount", "qcowfs unmount -z"}},
		{[]string{"mount", "-o", "uid=1000", src, mnt}, []string{"uid=1000", "owner"}},
		{[]string{"mount", "-o", "gid=1000", src, mnt}, []string{"gid=1000", "group"}},
		{[]string{"mount", "-o", "umask=022", src, mnt}, []string{"umask=022", "permission bits"}},
		{[]string{"mount", "-o", "context=system_u:object_r:tmp_t:s0", src, mnt}, []string{"context=", "SELinux"}},
		{[]string{"mount", "-o", "max_read=4096", src, mnt}, []string{"max_read=4096", "sets max_read itself"}},
		{[]string{"mount", "-o", "subtype=other", src, mnt}, []string{"subtype=other", "fuse.qcowfs"}},
	} {
		what := "qcowfs " + strings.Join(c.args, " ")
		r := harness.Run(t, c.args...)
		harness.WantError(t, what, r, c.words...)
		if r.Code != 2 {
			t.Errorf("%s: exit status %d, want 2 (a usage mistake)", what, r.Code)
		}
		if strings.Contains(r.Stdout+r.Stderr, "Usage:") {
			t.Errorf("%s printed a help page", what)
		}
		if m := harness.MountsUnder(t, mnt); len(m) != 0 {
			t.Errorf("%s mounted %v", what, m)
		}
		if p := harness.Daemons(t, mnt); len(p) != 0 {
			t.Errorf("%s left qcowfs processes %v", what, p)
		}
	}

	// Non-root without fusermount3: the binary run as nobody with a PATH
	// that has no fusermount3 in it.
	t.Run("not_root_without_fusermount3", func(t *testing.T) {
		setpriv, err := exec.LookPath("setpriv")
		if err != nil {
			t.Skip("setpriv not installed")
		}
		nobody, err := user.Lookup("nobody")
		if err != nil {
			t.Skip("no user nobody")
		}
		// nobody must reach the binary, the source and the mount point.
		d, bin := binaryForOthers(t)
		src := mkdir(t, d, "images")
		img, _ := smallImage(t, src, "vm")
		os.Chmod(img, 0o644)
		mnt := mkdir(t, d, "mnt")
		emptyBin := mkdir(t, d, "bin")
		harness.Cleanup(t, mnt)
		for _, args := range [][]string{{"mount", src, mnt}, {src, mnt, "-o", "ro"}} {
			cmd := exec.Command(setpriv, append([]string{"--reuid=" + nobody.Uid, "--regid=" + nobody.Gid, "--clear-groups", bin}, args...)...)
			cmd.Env = []string{"PATH=" + emptyBin}
			r := harness.RunCmd(t, cmd)
			harness.WantError(t, "qcowfs "+strings.Join(args, " ")+" as nobody", r, "fusermount3")
			if m := harness.MountsUnder(t, d); len(m) != 0 {
				t.Errorf("mounted: %v", m)
			}
			if p := harness.Daemons(t, mnt); len(p) != 0 {
				t.Errorf("qcowfs processes left: %v", p)
			}
		}
	})

	// Non-root, with fusermount3 failing: its own reason reaches the
	// user in one line, from the daemon as from --foreground. /dev/fuse
	// is made unopenable for nobody in a private mount namespace (a
	// root-only file bound over it), whatever its mode on this machine.
	t.Run("not_root_fusermount3_fails", func(t *testing.T) {
		for _, tool := range []string{"setpriv", "unshare", "fusermount3"} {
			if _, err := exec.LookPath(tool); err != nil {
				t.Fatalf("%s not installed", tool)
			}
		}
		nobody, err := user.Lookup("nobody")
		if err != nil {
			t.Fatal("no user nobody")
		}
		d := t.TempDir()
		for _, p := range []string{d, filepath.Dir(d)} {
			if err := os.Chmod(p, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		bin := filepath.Join(d, "qcowfs")
		b, err := os.ReadFile(harness.Bin())
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(bin, b, 0o755); err != nil {
			t.Fatal(err)
		}
		src := mkdir(t, d, "images")
		img, _ := smallImage(t, src, "vm")
		os.Chmod(img, 0o644)
		mnt := mkdir(t, d, "mnt")
		os.Chmod(mnt, 0o777)
		noFuse := writeFile(t, filepath.Join(d, "nofuse"), "")
		os.Chmod(noFuse, 0o600)
		run := mkdir(t, d, "run")
		uid, _ := strconv.Atoi(nobody.Uid)
		if err := os.Chown(run, uid, -1); err != nil {
			t.Fatal(err)
		}
		os.Chmod(run, 0o700)
		harness.Cleanup(t, mnt)
		const script = `mount --bind "$1" /dev/fuse && shift && exec "$@"`
		var msgs []string
		for _, args := range [][]string{{"mount", src, mnt}, {"mount", "--foreground", src, mnt}} {
			cmd := exec.Command("unshare", append([]string{"--mount", "sh", "-c", script, "sh", noFuse,
				"setpriv", "--reuid=" + nobody.Uid, "--regid=" + nobody.Gid, "--clear-groups", bin}, args...)...)
			cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "XDG_RUNTIME_DIR=" + run}
			r := harness.RunCmd(t, cmd)
			harness.WantError(t, "qcowfs "+strings.Join(args, " ")+" as nobody", r, "fusermount3: failed to open /dev/fuse: Permission denied")
			msgs = append(msgs, r.Stderr)
			if m := harness.MountsUnder(t, d); len(m) != 0 {
				t.Errorf("mounted: %v", m)
			}
			if p := harness.Daemons(t, mnt); len(p) != 0 {
				t.Errorf("qcowfs processes left: %v", p)
			}
		}
		if msgs[0] != msgs[1] {
			t.Errorf("the daemon says %q, --foreground %q", msgs[0], msgs[1])
		}
	})
}

// binaryForOthers returns a temporary folder that every user can enter,
// holding a copy of the qcowfs binary that every user can run: for tests
// that run qcowfs as another user (nobody).
func binaryForOthers(t *testing.T) (dir, bin string) {
	t.Helper()
	dir = t.TempDir()
	for _, p := range []string{dir, filepath.Dir(dir)} {
		if err := os.Chmod(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	bin = filepath.Join(dir, "qcowfs")
	b, err := os.ReadFile(harness.Bin())
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, b, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir, bin
}
