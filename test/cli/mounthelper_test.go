package cli

// Command line tests: the mount(8) helper convention and fstab.

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/harness"
)

// helperNamespace prepares for running mount(8) the way users do, with
// qcowfs installed where mount(8) finds it, without touching the system:
//
// mount(8) runs its helpers with an empty environment (util-linux 2.38
// drops PATH), so /sbin/mount.fuse3 finds "qcowfs" only in /bin/sh's
// default path (/usr/local/sbin:/usr/local/bin:/usr/sbin:...), whatever
// PATH the test sets. So the command runs in a private mount namespace in
// which a folder holding a qcowfs symlink is bind-mounted over
// /usr/local/sbin. The mount point lies in a folder bind-mounted shared,
// so that the FUSE mount made in that namespace appears in ours, where
// the test checks it and unmounts it with plain umount.
//
// It returns the shared folder, for the mount point, and a function that
// runs a command in such a namespace.
func helperNamespace(t *testing.T) (string, func(args ...string) harness.Result) {
	t.Helper()
	harness.RequireFUSE(t)
	for _, tool := range []string{"mount", "umount", "unshare", "findmnt", "/sbin/mount.fuse3"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not installed", tool)
		}
	}
	sbin := "/usr/local/sbin"
	if st, err := os.Stat(sbin); err != nil || !st.IsDir() {
		sbin = "/usr/local/bin"
	}
	if _, err := os.Stat(filepath.Join(sbin, "qcowfs")); err == nil {
		t.Logf("%s/qcowfs exists; hidden by the bind mount in the test namespace", sbin)
	}
	shared := t.TempDir()
	for _, args := range [][]string{{"--bind", shared, shared}, {"--make-shared", shared}} {
		harness.WantOK(t, "mount", harness.Exec(t, "mount", args...))
	}
	// Registered first, so it runs after the mount point's cleanup.
	t.Cleanup(func() { exec.Command("umount", "-l", shared).Run() })
	bin := t.TempDir()
	if err := os.Symlink(harness.Bin(), filepath.Join(bin, "qcowfs")); err != nil {
		t.Fatal(err)
	}
	const script = `set -e
# Keep the bind mount over $2 in this namespace: make the mount it lands
# on private here (not recursively: the shared folder stays shared).
mount --make-private "$(findmnt -n -o TARGET --target "$2")"
mount --bind "$1" "$2"
shift 2
exec "$@"`
	run := func(args ...string) harness.Result {
		t.Helper()
		cmd := exec.Command("unshare", append([]string{"--mount", "--propagation", "unchanged",
			"sh", "-c", script, "sh", bin, sbin}, args...)...)
		// qcowfs first in PATH too, as a user would have it;
		// mount(8) drops PATH before running mount.fuse3 anyway.
		cmd.Env = append(os.Environ(), "PATH="+filepath.Dir(harness.Bin())+":"+os.Getenv("PATH"))
		return harness.RunCmd(t, cmd)
	}
	return shared, run
}

// checkHelperMount checks a mount made by mount(8): live, a qcowfs
// daemon behind it, allow_other and read-only as asked, and the image's
// bytes as qemu-img convert makes them. Then plain umount unmounts it and
// the daemon exits.
func checkHelperMount(t *testing.T, mnt, src, raw string) {
	t.Helper()
	m := harness.MountAt(t, mnt)
	if m == nil || m.FSType != "fuse.qcowfs" {
		t.Fatalf("%s: mounted as %+v, want fuse.qcowfs", mnt, m)
	}
	if m.Source != src {
		t.Errorf("mount source %q, want %q", m.Source, src)
	}
	opts := strings.Split(m.SuperOptions, ",")
	for _, o := range []string{"ro", "allow_other"} {
		if !slices.Contains(opts, o) {
			t.Errorf("mount options %s lack %s", m.SuperOptions, o)
		}
	}
	daemon := harness.DaemonOf(t, mnt)
	if exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", daemon)); err != nil || exe != harness.Bin() {
		t.Errorf("the daemon runs %q (%v), want the binary under test %s", exe, err, harness.Bin())
	}
	harness.SameFile(t, filepath.Join(mnt, "vm.raw"), raw)
	harness.WantOK(t, "umount", harness.Exec(t, "umount", mnt))
	if harness.IsMounted(mnt) {
		t.Fatalf("%s still mounted after umount", mnt)
	}
	harness.WaitGone(t, mnt)
}

// TestHelperMount: mount -t fuse.qcowfs SRC MNT -o ro,allow_other, which
// mount(8) turns into /sbin/mount.fuse3 ..., which runs qcowfs SRC MNT -o
// ro,allow_other,dev,suid.
func TestHelperMount(t *testing.T) {
	shared, run := helperNamespace(t)
	src := t.TempDir()
	_, raw := smallImage(t, src, "vm")
	mnt := mkdir(t, shared, "mnt")
	harness.Cleanup(t, mnt)
	r := run("mount", "-t", "fuse.qcowfs", src, mnt, "-o", "ro,allow_other")
	harness.WantOK(t, "mount -t fuse.qcowfs", r)
	checkHelperMount(t, mnt, src, raw)
}

// TestFstabMount: an fstab line "SRC MNT fuse.qcowfs ro,allow_other 0 0",
// from a private fstab file (mount --fstab), not /etc/fstab.
func TestFstabMount(t *testing.T) {
	shared, run := helperNamespace(t)
	src := t.TempDir()
	_, raw := smallImage(t, src, "vm")
	mnt := mkdir(t, shared, "mnt")
	harness.Cleanup(t, mnt)
	esc := strings.NewReplacer(" ", `\040`, "\t", `\011`, `\`, `\134`).Replace
	fstab := writeFile(t, filepath.Join(t.TempDir(), "fstab"),
		fmt.Sprintf("# qcowfs test\n%s %s fuse.qcowfs ro,allow_other 0 0\n", esc(src), esc(mnt)))
	r := run("mount", "--fstab", fstab, mnt)
	harness.WantOK(t, "mount --fstab", r)
	checkHelperMount(t, mnt, src, raw)
}

// TestHelperAsMountQcowfs: installed as /sbin/mount.qcowfs, qcowfs is run
// by mount(8) directly, with mount(8)'s own flags: -s, -n, -v, -o OPTS, -t
// TYPE (for a helper whose name does not end with the type) and -f (fake:
// record the mount, do nothing). argv[0] is what tells qcowfs.
func TestHelperAsMountQcowfs(t *testing.T) {
	harness.RequireFUSE(t)
	src := t.TempDir()
	_, raw := smallImage(t, src, "vm")
	helper := func(args ...string) *exec.Cmd {
		cmd := exec.Command(harness.Bin(), args...)
		cmd.Args[0] = "/sbin/mount.qcowfs"
		return cmd
	}

	mnt := t.TempDir()
	harness.Cleanup(t, mnt)
	harness.WantOK(t, "mount.qcowfs", harness.RunCmd(t, helper(src, mnt, "-s", "-n", "-v", "-o", "ro,allow_other,noatime", "-t", "fuse.qcowfs")))
	checkHelperMount(t, mnt, src, raw)

	// mount -f: nothing is mounted, nothing stays running. (Were -f
	// taken for --foreground, this would mount and never return.)
	mnt = t.TempDir()
	harness.Cleanup(t, mnt)
	r := harness.RunCmdTimeout(t, helper(src, mnt, "-f", "-o", "ro"), 10*time.Second)
	harness.WantOK(t, "mount.qcowfs -f", r)
	if harness.IsMounted(mnt) {
		t.Errorf("mount.qcowfs -f (fake) mounted %s", mnt)
	}
	if p := harness.Daemons(t, mnt); len(p) != 0 {
		t.Errorf("mount.qcowfs -f left processes %v", p)
	}
	// Options are still checked.
	harness.WantError(t, "mount.qcowfs -f -o bogus", harness.RunCmd(t, helper(src, mnt, "-f", "-o", "bogus")), "bogus")
}

// TestHelperFakeMount: mount -f (fake) through mount.fuse3, which drops
// the -f before running qcowfs: nothing is mounted, nothing keeps running,
// exit 0; from the command line and from an fstab.
func TestHelperFakeMount(t *testing.T) {
	shared, run := helperNamespace(t)
	src := t.TempDir()
	smallImage(t, src, "vm")
	mnt := mkdir(t, shared, "mnt")
	harness.Cleanup(t, mnt)
	fstab := writeFile(t, filepath.Join(t.TempDir(), "fstab"), fmt.Sprintf("%s %s fuse.qcowfs ro,allow_other 0 0\n", src, mnt))
	for _, args := range [][]string{
		{"mount", "-f", "-t", "fuse.qcowfs", src, mnt, "-o", "ro"},
		{"mount", "--fake", "-v", "-t", "fuse.qcowfs", src, mnt},
		{"mount", "-fv", "--fstab", fstab, mnt},
	} {
		r := run(args...)
		harness.WantOK(t, strings.Join(args, " "), r)
		if m := harness.MountAt(t, mnt); m != nil {
			t.Errorf("%s mounted %s: %+v", strings.Join(args, " "), mnt, m)
		}
		if p := harness.Daemons(t, mnt); len(p) != 0 {
			t.Errorf("%s left qcowfs processes %v", strings.Join(args, " "), p)
		}
	}
	// Without -f, the same mounts.
	harness.WantOK(t, "mount --fstab", run("mount", "--fstab", fstab, mnt))
	if m := harness.MountAt(t, mnt); m == nil || m.FSType != "fuse.qcowfs" {
		t.Fatalf("mount --fstab did not mount: %+v", m)
	}
	harness.WantOK(t, "umount", harness.Exec(t, "umount", mnt))
	harness.WaitGone(t, mnt)
}

// TestFstabNofail: an fstab line with nofail whose source is missing
// makes mount(8) exit 0 and mount nothing, as it does for a missing
// device of a kernel file system (libmount: nofail forgives ENOENT of the
// source); without nofail it fails with the reason. mount.fuse3 drops
// nofail, so qcowfs finds it in the fstab line mount(8) mounts.
func TestFstabNofail(t *testing.T) {
	shared, run := helperNamespace(t)
	missing := filepath.Join(t.TempDir(), "no such images")
	mnt := mkdir(t, shared, "mnt")
	harness.Cleanup(t, mnt)
	esc := strings.NewReplacer(" ", `\040`).Replace
	for _, c := range []struct {
		opts string
		ok   bool
	}{{"ro,nofail", true}, {"ro", false}} {
		fstab := writeFile(t, filepath.Join(t.TempDir(), "fstab"), fmt.Sprintf("%s %s fuse.qcowfs %s 0 0\n", esc(missing), esc(mnt), c.opts))
		for _, args := range [][]string{{"mount", "--fstab", fstab, mnt}, {"mount", "-a", "--fstab", fstab}} {
			r := run(args...)
			what := strings.Join(args, " ") + " (" + c.opts + ")"
			if c.ok {
				harness.WantOK(t, what, r)
				if r.Stderr != "" {
					t.Errorf("%s printed %q; want silence, as mount(8) for nofail", what, r.Stderr)
				}
			} else if r.Code == 0 || !strings.Contains(r.Stderr, "no such images") {
				t.Errorf("%s: exit status %d, stderr %q; want a failure naming the source", what, r.Code, r.Stderr)
			}
			if m := harness.MountAt(t, mnt); m != nil {
				t.Errorf("%s mounted %+v", what, m)
			}
		}
	}
	// nofail on mount(8)'s command line.
	r := run("mount", "-t", "fuse.qcowfs", "-o", "ro,nofail", missing, mnt)
	harness.WantOK(t, "mount -o nofail (missing source)", r)
}

// TestREADMESystemdUnit: the README's mount unit is named after its Where=
// as systemd-escape names it, systemd-analyze verify takes it without a
// word, and the mount systemd makes of it (mount WHAT WHERE -t TYPE -o
// OPTIONS, with What= and Where= moved to the test's folders) works.
func TestREADMESystemdUnit(t *testing.T) {
	for _, tool := range []string{"systemd-analyze", "systemd-escape"} {
		if _, err := exec.LookPath(tool); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("%s (package systemd) is required under CI=true", tool)
			}
			t.Skipf("%s not installed", tool)
		}
	}
	b, err := os.ReadFile(filepath.Join(harness.Root(t), "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile("(?s)\n( *)```ini\n(.*?)\n *```\n").FindSubmatch(b)
	if m == nil {
		t.Fatal("README.md has no ```ini block (the systemd mount unit)")
	}
	var lines []string
	for _, l := range strings.Split(string(m[2]), "\n") {
		lines = append(lines, strings.TrimPrefix(l, string(m[1])))
	}
	unit := strings.Join(lines, "\n") + "\n"
	name := strings.TrimPrefix(lines[0], "# /etc/systemd/system/")
	keys := map[string]string{}
	for _, l := range lines {
		if k, v, ok := strings.Cut(l, "="); ok && !strings.HasPrefix(l, "#") {
			keys[k] = v
		}
	}
	for _, k := range []string{"What", "Where", "Type", "Options"} {
		if keys[k] == "" {
			t.Fatalf("the README's unit has no %s=:\n%s", k, unit)
		}
	}
	esc, err := exec.Command("systemd-escape", "--path", "--suffix=mount", keys["Where"]).Output()
	if err != nil {
		t.Fatal(err)
	}
	if want := strings.TrimSpace(string(esc)); name != want {
		t.Errorf("the README's unit is called %q; for Where=%s systemd wants %q", name, keys["Where"], want)
	}
	if keys["Type"] != "fuse.qcowfs" {
		t.Errorf("the README's unit mounts Type=%s, want fuse.qcowfs", keys["Type"])
	}
	path := filepath.Join(t.TempDir(), name)
	writeFile(t, path, unit)
	r := harness.Exec(t, "systemd-analyze", "verify", path)
	if r.Code != 0 || r.Stdout != "" || r.Stderr != "" {
		t.Errorf("systemd-analyze verify %s: exit %d\n%s%s\nunit:\n%s", name, r.Code, r.Stdout, r.Stderr, unit)
	}

	// The mount itself, as systemd runs it, with the unit's options.
	shared, run := helperNamespace(t)
	src := t.TempDir()
	_, raw := smallImage(t, src, "vm")
	mnt := mkdir(t, shared, "mnt")
	harness.Cleanup(t, mnt)
	harness.WantOK(t, "mount with the unit's options", run("mount", src, mnt, "-t", keys["Type"], "-o", keys["Options"]))
	checkHelperMount(t, mnt, src, raw)
}

// TestReadOnlyWarnings: asked for writes in a way that leaves the mount
// read-only, qcowfs mounts read-only and says so in one warning line: the
// rw option alone (qcowfs writes only with writable), by qcowfs mount -o,
// as a helper, and through mount(8) with -o rw or -w, or rw in the fstab
// line; ro beside writable (ro wins). mount(8) passes rw to every helper
// unasked: a mount(8) mount without it, or with writable, says nothing.
// Before, none of them said anything.
func TestReadOnlyWarnings(t *testing.T) {
	shared, run := helperNamespace(t)
	src := t.TempDir()
	smallImage(t, src, "vm")
	const rwWarning = "qcowfs: warning: option rw: the mount is read-only"
	const roWarning = "qcowfs: warning: ro and writable both given: ro wins, the mount is read-only"
	fstabOf := func(mnt, opts string) string {
		return writeFile(t, filepath.Join(t.TempDir(), "fstab"), fmt.Sprintf("%s %s fuse.qcowfs %s 0 0\n", src, mnt, opts))
	}
	for i, c := range []struct {
		args     func(mnt string) []string
		byMount  bool
		warning  string
		readOnly bool
	}{
		{func(mnt string) []string { return []string{"mount", "-o", "rw", src, mnt} }, false, rwWarning, true},
		{func(mnt string) []string { return []string{src, mnt, "-o", "rw,allow_other"} }, false, rwWarning, true},
		{func(mnt string) []string { return []string{"mount", "-o", "writable,ro", src, mnt} }, false, roWarning, true},
		{func(mnt string) []string { return []string{"mount", "--writable", "-o", "ro", src, mnt} }, false, roWarning, true},
		{func(mnt string) []string { return []string{"mount", "-o", "rw,writable", src, mnt} }, false, "", false},
		{func(mnt string) []string { return []string{"mount", "-t", "fuse.qcowfs", src, mnt, "-o", "rw"} }, true, rwWarning, true},
		{func(mnt string) []string { return []string{"mount", "-w", "-t", "fuse.qcowfs", src, mnt} }, true, rwWarning, true},
		{func(mnt string) []string { return []string{"mount", "--fstab", fstabOf(mnt, "rw,allow_other"), mnt} }, true, rwWarning, true},
		{func(mnt string) []string { return []string{"mount", "-t", "fuse.qcowfs", src, mnt} }, true, "", true},
		{func(mnt string) []string { return []string{"mount", "--fstab", fstabOf(mnt, "defaults"), mnt} }, true, "", true},
		{func(mnt string) []string { return []string{"mount", "-t", "fuse.qcowfs", src, mnt, "-o", "writable"} }, true, "", false},
	} {
		mnt := mkdir(t, shared, fmt.Sprintf("mnt%d", i))
		harness.Cleanup(t, mnt)
		args := c.args(mnt)
		what := strings.Join(args, " ")
		var r harness.Result
		if c.byMount {
			r = run(args...)
		} else {
			r = harness.Run(t, args...)
		}
		harness.WantOK(t, what, r)
		var said []string
		for _, line := range strings.Split(strings.TrimSpace(r.Stderr), "\n") {
			if strings.HasPrefix(line, "qcowfs: warning: ") {
				said = append(said, line)
			}
		}
		switch {
		case c.warning == "" && len(said) != 0:
			t.Errorf("%s: warned %q, want no warning", what, said)
		case c.warning != "" && (len(said) != 1 || !strings.HasPrefix(said[0], c.warning)):
			t.Errorf("%s: warned %q, want one line %q...", what, said, c.warning)
		}
		m := harness.MountAt(t, mnt)
		if m == nil {
			t.Fatalf("%s: nothing mounted on %s", what, mnt)
		}
		if ro := slices.Contains(strings.Split(m.Options, ","), "ro"); ro != c.readOnly {
			t.Errorf("%s: mounted with %s, want read-only %v", what, m.Options, c.readOnly)
		}
		harness.WantOK(t, "umount", harness.Exec(t, "umount", mnt))
		harness.WaitGone(t, mnt)
	}
}
