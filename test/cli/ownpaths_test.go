package cli

import (
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/harness"
)

// TestOwnPathsRefused: a file or folder the mount reads or writes for
// itself (--cache-dir, --overlay=temp's $TMPDIR, --key-dir, --key-file,
// --log-file, --cpu-profile, --allow-backing-outside) inside the mount
// point, where the daemon would wait on its own mount, or inside the
// source folder, where the mount would show it, is refused before
// anything is mounted: one line naming the flag, a non-zero exit within
// seconds, nothing mounted, no daemon, nothing made there. Paths are
// resolved as the caller gives them: relative to its working folder,
// through symlinks, missing parts included. Before, --cache-dir and
// $TMPDIR inside the mount point mounted (exit 0, after 10 s) and hung
// every access; the others mounted.
func TestOwnPathsRefused(t *testing.T) {
	harness.RequireFUSE(t)
	root := t.TempDir()
	src := mkdir(t, root, "images")
	img, _ := smallImage(t, src, "vm")
	mnt := mkdir(t, root, "mnt")
	// A symlink into the mount point, and one dangling into it.
	if err := os.Symlink(mnt, filepath.Join(root, "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(mnt, "not-yet"), filepath.Join(root, "dangling")); err != nil {
		t.Fatal(err)
	}
	keyInSrc := writeFile(t, filepath.Join(src, "vm.key"), "passphrase")
	os.Chmod(keyInSrc, 0o600)
	// Key folders a user had there before mounting over them.
	mkdir(t, mnt, "keys")
	mkdir(t, src, "keys")
	// A TMPDIR there too.
	mkdir(t, mnt, "tmp")
	imgBefore, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	const inMnt, inSrc = "inside the mount point", "inside the source folder"
	cases := []struct {
		name  string
		args  []string
		env   []string
		words []string
	}{
		{"cache dir", []string{"--cache-dir", filepath.Join(mnt, "cache")}, nil, []string{"--cache-dir", inMnt}},
		{"cache dir relative through a symlink", []string{"--cache-dir", "link/cache"}, nil, []string{"--cache-dir", inMnt}},
		{"cache dir through a dangling symlink", []string{"--cache-dir", "dangling/cache"}, nil, []string{"--cache-dir", inMnt}},
		{"cache dir in source", []string{"--cache-dir", filepath.Join(src, "cache")}, nil, []string{"--cache-dir", inSrc}},
		{"temp overlays TMPDIR", []string{"--writable", "--overlay=temp"}, []string{"TMPDIR=" + filepath.Join(mnt, "tmp")}, []string{"--overlay=temp", "TMPDIR=", inMnt}},
		{"temp overlays TMPDIR relative", []string{"--writable", "--overlay=temp"}, []string{"TMPDIR=mnt/tmp"}, []string{"--overlay=temp", "TMPDIR=", inMnt}},
		{"temp overlays TMPDIR in source", []string{"--writable", "--overlay=temp"}, []string{"TMPDIR=" + src}, []string{"--overlay=temp", inSrc}},
		{"key dir", []string{"--key-dir", filepath.Join(mnt, "keys")}, nil, []string{"--key-dir", inMnt}},
		{"key dir in source", []string{"--key-dir", filepath.Join(src, "keys")}, nil, []string{"--key-dir", inSrc}},
		{"key file in source", []string{"--key-file", keyInSrc}, nil, []string{"--key-file", inSrc}},
		{"log file", []string{"--log-file", filepath.Join(mnt, "qcowfs.log")}, nil, []string{"--log-file", inMnt}},
		{"log file in source", []string{"--log-file", filepath.Join(src, "qcowfs.log")}, nil, []string{"--log-file", inSrc}},
		{"cpu profile", []string{"--cpu-profile", filepath.Join(mnt, "cpu.pprof")}, nil, []string{"--cpu-profile", inMnt}},
		{"backing files from inside the mount", []string{"--allow-backing-outside", filepath.Join(mnt, "bases")}, nil, []string{"--allow-backing-outside", inMnt}},
		{"log file is the single image", []string{"--log-file", img}, nil, []string{"--log-file", "is the source image"}},
	}
	for _, c := range cases {
		t.Run(strings.ReplaceAll(c.name, " ", "_"), func(t *testing.T) {
			harness.Cleanup(t, mnt)
			source := src
			if strings.Contains(c.name, "single image") {
				source = img
			}
			args := append(append([]string{"mount"}, c.args...), source, mnt)
			mountsBefore := harness.MountsUnder(t, root)
			mntBefore, srcBefore := harness.Names(t, mnt), harness.Names(t, src)
			cmd := exec.Command(harness.Bin(), args...)
			cmd.Dir = root
			cmd.Env = append(os.Environ(), c.env...)
			r := harness.RunCmdTimeout(t, cmd, 20*time.Second)
			harness.WantError(t, "qcowfs "+strings.Join(args, " "), r, c.words...)
			if after := harness.MountsUnder(t, root); !reflect.DeepEqual(after, mountsBefore) {
				// (The mount point is not read: it may hang.)
				t.Fatalf("mounts under %s changed:\nbefore %v\nafter  %v", root, mountsBefore, after)
			}
			if p := harness.Daemons(t, mnt); len(p) != 0 {
				t.Errorf("qcowfs processes left: %v", p)
			}
			if names := harness.Names(t, mnt); !reflect.DeepEqual(names, mntBefore) {
				t.Errorf("the mount point held %v, now %v", mntBefore, names)
			}
			if names := harness.Names(t, src); !reflect.DeepEqual(names, srcBefore) {
				t.Errorf("the source folder held %v, now %v", srcBefore, names)
			}
		})
	}
	if b, err := os.ReadFile(img); err != nil || string(b) != string(imgBefore) {
		t.Errorf("the image changed (%v)", err)
	}
}
