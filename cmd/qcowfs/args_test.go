package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/qcowfs/qcowfs/remote"
)

func TestPrepareArgs(t *testing.T) {
	k, err := newParser(os.Stdout, os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for _, tc := range []struct{ in, want []string }{
		{[]string{"qcowfs", "mount", "a", "b"}, []string{"qcowfs", "mount", "a", "b"}},
		{[]string{"qcowfs", "info", "x.qcow2"}, []string{"qcowfs", "info", "x.qcow2"}},
		// mount.fuse3 runs "qcowfs SRC MNT -o OPTS".
		{[]string{"qcowfs", "/src", "/mnt", "-o", "ro,allow_other,dev,suid"}, []string{"qcowfs", "mount", "/src", "/mnt", "--ro", "--allow-other"}},
		// mount(8) runs /sbin/mount.qcowfs SRC MNT [-sfnv] [-o OPTS] [-t TYPE].
		{[]string{"/sbin/mount.qcowfs", "/src", "/mnt", "-n", "-o", "ro", "-t", "fuse.qcowfs"}, []string{"/sbin/mount.qcowfs", "mount", "/src", "/mnt", "--ro"}},
		{[]string{"/sbin/mount.qcowfs", "/src", "/mnt", "-f"}, []string{"/sbin/mount.qcowfs", "mount", "/src", "/mnt", "--fake"}},
		// A source in the working folder, named without a slash.
		{[]string{"qcowfs", filepath.Base(dir), "m"}, []string{"qcowfs", "mount", filepath.Base(dir), "m"}},
		{[]string{"qcowfs", "--help"}, []string{"qcowfs", "--help"}},
		{[]string{"qcowfs"}, []string{"qcowfs", "--help"}},
		{[]string{"qcowfs", "help"}, []string{"qcowfs", "--help"}},
		{[]string{"qcowfs", "help", "map"}, []string{"qcowfs", "map", "--help"}},
		// Every flag is an option; quotes keep a comma in a value.
		{[]string{"qcowfs", "mount", "-o", `cache_size=1M,allow_backing_outside="/a,b",x-systemd.automount,nofail`, "s", "m"},
			[]string{"qcowfs", "mount", "--cache-size=1M", "--allow-backing-outside=/a,b", "--nofail", "s", "m"}},
		{[]string{"qcowfs", "mount", "-oforce_share", "--options=fsname=vms", "s", "m"}, []string{"qcowfs", "mount", "--force-share", "--fsname=vms", "s", "m"}},
		// hydrate goes with or without a value.
		{[]string{"qcowfs", "mount", "-o", "hydrate,overlay=temp", "s", "m"}, []string{"qcowfs", "mount", "--hydrate", "--overlay=temp", "s", "m"}},
		{[]string{"qcowfs", "mount", "-o", "hydrate=50M", "s", "m"}, []string{"qcowfs", "mount", "--hydrate=50M", "s", "m"}},
	} {
		wd, _ := os.Getwd()
		os.Chdir(filepath.Dir(dir))
		inv, err := prepareArgs(k.Model, tc.in)
		os.Chdir(wd)
		if err != nil {
			t.Errorf("prepareArgs(%q): %v", tc.in, err)
			continue
		}
		if !slices.Equal(inv.args, tc.want) {
			t.Errorf("prepareArgs(%q) = %q, want %q", tc.in, inv.args, tc.want)
		}
	}
	for _, tc := range []struct {
		in   []string
		want string
	}{
		{[]string{"qcowfs", "inof", "x.qcow2"}, `unknown command "inof"; did you mean "info"?`},
		{[]string{"qcowfs", "chek", "a", "b"}, `unknown command "chek"; did you mean "check"?`},
		{[]string{"qcowfs", "help", "mout"}, `unknown command "mout"; did you mean "mount"?`},
		{[]string{"qcowfs", "frobnicate"}, `unknown command "frobnicate" (commands:`},
		{[]string{"qcowfs", "mount", "-o", "bogus", "s", "m"}, `unknown mount option "bogus"`},
		{[]string{"qcowfs", "mount", "-o", "uid=1000", "s", "m"}, `option uid=1000: not supported`},
		{[]string{"qcowfs", "mount", "-o", "allow_other=1", "s", "m"}, `option allow_other takes no value`},
		{[]string{"qcowfs", "mount", "-o", "cache_size", "s", "m"}, `option cache_size needs a value`},
		{[]string{"qcowfs", "mount", "-o", "subtype=other", "s", "m"}, `the type stays fuse.qcowfs`},
	} {
		_, err := prepareArgs(k.Model, tc.in)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("prepareArgs(%q): %v, want an error with %q", tc.in, err, tc.want)
		}
	}
}

func TestParseMountArgs(t *testing.T) {
	dir := t.TempDir()
	fstab := filepath.Join(dir, "fstab")
	os.WriteFile(fstab, []byte("# c\n/srv/a /mnt/a\\040b fuse.qcowfs ro,nofail 0 0\n/srv/c /mnt/c fuse.qcowfs ro 0 0\n/srv/d /mnt/d fuse.qcowfs rw,allow_other 0 0\n"), 0o644)
	for _, tc := range []struct {
		args             []string
		mnt              string
		fake, nofail, rw bool
	}{
		{[]string{"-t", "fuse.qcowfs", "/s", "/m", "-o", "allow_other,rw"}, "/m", false, false, true},
		{[]string{"-w", "-t", "fuse.qcowfs", "/s", "/m"}, "/m", false, false, true},
		{[]string{"--read-write", "/s", "/m"}, "/m", false, false, true},
		{[]string{"-t", "fuse.qcowfs", "/s", "/m", "-o", "writable"}, "/m", false, false, false},
		{[]string{"-T", fstab, "/mnt/d"}, "/mnt/d", false, false, true},
		{[]string{"-T", fstab, "/mnt/c"}, "/mnt/c", false, false, false},
		{[]string{"-f", "-t", "fuse.qcowfs", "/s", "/m", "-o", "ro"}, "/m", true, false, false},
		{[]string{"-vf", "-t", "fuse.qcowfs", "/s", "/m"}, "/m", true, false, false},
		{[]string{"--fake", "/s", "/m"}, "/m", true, false, false},
		// -f as the value of -t or -o is no fake.
		{[]string{"-t", "-f", "-o", "-f", "/s", "/m"}, "/m", false, false, false},
		{[]string{"-ofoo,nofail", "/s", "/m"}, "/m", false, true, false},
		{[]string{"-T", fstab, "/mnt/a b"}, "/mnt/a b", false, true, false},
		{[]string{"--fstab=" + fstab, "/mnt/c"}, "/mnt/c", false, false, false},
		{[]string{"-afT", fstab}, "/mnt/a b", true, true, false},
	} {
		p := parseMountArgs(1, tc.args, []string{"qcowfs", "/s", tc.mnt})
		if p.fake != tc.fake || p.nofail != tc.nofail || p.rw != tc.rw {
			t.Errorf("mount %q for %s: fake %v nofail %v rw %v, want %v %v %v", tc.args, tc.mnt, p.fake, p.nofail, p.rw, tc.fake, tc.nofail, tc.rw)
		}
	}
}

func TestRuntimeName(t *testing.T) {
	for in, want := range map[string]string{
		"/mnt/vms": "mnt-vms.log", "/mnt/my vms/": `mnt-my\x20vms.log`, "/a-b": `a\x2db.log`,
		"/.hidden/x": `\x2ehidden-x.log`, "/": "-.log", "/a//b": "a-b.log",
	} {
		if got := runtimeName(in, ".log"); got != want {
			t.Errorf("runtimeName(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestEditDistance(t *testing.T) {
	for _, tc := range []struct {
		a, b string
		d    int
	}{{"inof", "info", 1}, {"chek", "check", 1}, {"mount", "mount", 0}, {"", "map", 3}, {"umonut", "umount", 1}} {
		if got := editDistance(tc.a, tc.b); got != tc.d {
			t.Errorf("editDistance(%q, %q) = %d, want %d", tc.a, tc.b, got, tc.d)
		}
	}
}

func TestByteSize(t *testing.T) {
	for in, want := range map[string]int64{"0": 0, "4096": 4096, "32M": 32 << 20, "1G": 1 << 30, "512k": 512 << 10, "2MiB": 2 << 20, "1T": 1 << 40} {
		var b byteSize
		if err := b.UnmarshalText([]byte(in)); err != nil || int64(b) != want {
			t.Errorf("%q = %d, %v; want %d", in, b, err, want)
		}
	}
	for _, in := range []string{"", "x", "-1", "1X", "1.5G", "99999999999T"} {
		var b byteSize
		if err := b.UnmarshalText([]byte(in)); err == nil {
			t.Errorf("%q accepted as %d", in, b)
		}
	}
}

// TestRuntimeNameSystemd: the names are systemd-escape --path's, where it
// is installed.
func TestRuntimeNameSystemd(t *testing.T) {
	if _, err := exec.LookPath("systemd-escape"); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("systemd-escape (package systemd) is required under CI=true")
		}
		t.Skip("systemd-escape not installed")
	}
	for _, p := range []string{"/mnt/vms", "/mnt/my vms", "/srv/a-b/c_d.e", "/.x/ü/東", "/a\\b:c", "/"} {
		out, err := exec.Command("systemd-escape", "--path", p).Output()
		if err != nil {
			t.Fatal(err)
		}
		if got, want := runtimeName(p, ""), strings.TrimSpace(string(out)); got != want {
			t.Errorf("runtimeName(%q) = %q, systemd-escape --path says %q", p, got, want)
		}
	}
}

// TestControlPath: the control socket is named after the mount point;
// for a mount point too deep for a unix socket's path (sun_path), the
// name is cut and a hash keeps it apart from its neighbours.
func TestControlPath(t *testing.T) {
	if got, want := controlPath("/srv/vms"), filepath.Join(runtimeDir(), "srv-vms.sock"); got != want {
		t.Errorf("controlPath(/srv/vms) = %q, want %q", got, want)
	}
	deep := "/srv/" + strings.Repeat("images-of-the-lab/", 8)
	a, b := controlPath(deep+"a"), controlPath(deep+"b")
	for _, p := range []string{a, b} {
		if len(p) > maxSocketPath || filepath.Dir(p) != runtimeDir() || !strings.HasPrefix(filepath.Base(p), "srv-images") || !strings.HasSuffix(p, ".sock") {
			t.Errorf("controlPath of a deep mount point = %q (%d bytes); want at most %d, in %s, starting like the mount point", p, len(p), maxSocketPath, runtimeDir())
		}
	}
	if a == b || a != controlPath(deep+"a/") {
		t.Errorf("deep mount points: %q and %q; want distinct names, the same for the same mount point", a, b)
	}
}

// TestHydrateFlag: --hydrate alone is on without a cap; --hydrate=RATE
// sets the cap; a bad or zero rate is refused.
func TestHydrateFlag(t *testing.T) {
	for _, tc := range []struct {
		args []string
		on   bool
		rate byteSize
		bad  bool
	}{
		{nil, false, 0, false},
		{[]string{"--hydrate"}, true, 0, false},
		{[]string{"--hydrate=50M"}, true, 50 << 20, false},
		{[]string{"--hydrate=1048576"}, true, 1 << 20, false},
		{[]string{"--hydrate=fast"}, false, 0, true},
		{[]string{"--hydrate=0"}, false, 0, true},
	} {
		k, err := newParser(os.Stdout, os.Stderr)
		if err != nil {
			t.Fatal(err)
		}
		_, err = k.Parse(append(append([]string{"mount"}, tc.args...), "https://h/vm.qcow2", "/mnt"))
		if tc.bad {
			if err == nil {
				t.Errorf("%q: parsed; want an error", tc.args)
			}
			continue
		}
		if err != nil {
			t.Errorf("%q: %v", tc.args, err)
			continue
		}
		c := &k.Model.Target.Addr().Interface().(*cli).Mount
		if c.Hydrate.On != tc.on || c.Hydrate.Rate != tc.rate {
			t.Errorf("%q: hydrate %+v, want on %v, rate %d", tc.args, c.Hydrate, tc.on, tc.rate)
		}
	}
}

func TestHydrationProgress(t *testing.T) {
	for _, tc := range []struct {
		hs      []remote.HydrationStatus
		want    string
		running bool
	}{
		{[]remote.HydrationStatus{{Needed: 4 << 20, Done: 1 << 20, Rate: 2 << 20, State: "running"}, {Needed: 4 << 20, Done: 4 << 20, State: "complete"}},
			"hydrating 1 file: 62.5% of 8.0 MiB, 2.0 MiB/s", true},
		{[]remote.HydrationStatus{{Needed: 3 << 30, Done: 3 << 30, State: "complete"}, {Needed: 1 << 30, Done: 1 << 29, State: "bounded"}},
			"hydrated 2 files: 87.5% of 4.0 GiB", false},
	} {
		if got, running := hydrationProgress(tc.hs); got != tc.want || running != tc.running {
			t.Errorf("hydrationProgress(%+v) = %q, %v; want %q, %v", tc.hs, got, running, tc.want, tc.running)
		}
	}
}
