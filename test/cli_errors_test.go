package test

// Command line tests: user mistakes, each one line on stderr and nothing mounted.

import (
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

// TestCLIErrors: every user mistake is one line on stderr, a non-zero
// exit, no mount and no daemon.
func TestCLIErrors(t *testing.T) {
	requireFUSE(t)
	root := t.TempDir()
	src := cliMkdir(t, root, "images")
	cliImage(t, src, "vm")
	notImage := cliWrite(t, filepath.Join(root, "notimage.qcow2"), strings.Repeat("not a qcow2 image\n", 1000))
	regular := cliWrite(t, filepath.Join(root, "file"), "a regular file\n")
	mnt := cliMkdir(t, root, "mnt")
	inside := cliMkdir(t, src, "sub")
	tmpfs := cliMkdir(t, root, "tmpfs")
	cliTmpfs(t, tmpfs)
	qcowMnt := mountImages(t, src).Dir
	// A source inside the mount point: the mount would hide it from the
	// daemon itself.
	outer := cliMkdir(t, root, "outer")
	hiddenSrc := cliMkdir(t, outer, "images")
	cliImage(t, hiddenSrc, "hidden")

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
			cliCleanup(t, c.mnt)
			mountsBefore := cliMountsUnder(t, root)
			daemonsBefore := cliDaemons(t, c.mnt)
			// Errors are found before anything is mounted: quickly.
			r := cliRunCmdTimeout(t, exec.Command(qcowfsBin, c.args...), 20*time.Second)
			cliWantError(t, "qcowfs "+strings.Join(c.args, " "), r, c.words...)
			if after := cliMountsUnder(t, root); !reflect.DeepEqual(after, mountsBefore) {
				t.Errorf("mounts under %s changed:\nbefore %v\nafter  %v", root, mountsBefore, after)
			}
			if after := cliDaemons(t, c.mnt); !reflect.DeepEqual(after, daemonsBefore) {
				t.Errorf("qcowfs processes for %s: before %v, after %v", c.mnt, daemonsBefore, after)
			}
		})
	}

	// Command line syntax errors: kong prints the command's usage on
	// stdout, and the reason as one line on stderr.
	for _, args := range [][]string{{"mount", src}, {"mount", "--no-such-flag", src, mnt}, {"mount", "--log-level", "loud", src, mnt}, {"frobnicate"}} {
		r := cliRun(t, args...)
		if r.code == 0 || !strings.HasPrefix(r.stderr, "qcowfs: ") || strings.Count(r.stderr, "\n") != 1 {
			t.Errorf("qcowfs %s: status %d, stderr %q; want an error, in one line", strings.Join(args, " "), r.code, r.stderr)
		}
		if m := cliMountsUnder(t, mnt); len(m) != 0 {
			t.Errorf("qcowfs %s mounted %v", strings.Join(args, " "), m)
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
		d := t.TempDir()
		// nobody must reach the binary, the source and the mount point.
		for _, p := range []string{d, filepath.Dir(d)} {
			if err := os.Chmod(p, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		bin := filepath.Join(d, "qcowfs")
		b, err := os.ReadFile(qcowfsBin)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(bin, b, 0o755); err != nil {
			t.Fatal(err)
		}
		src := cliMkdir(t, d, "images")
		img, _ := cliImage(t, src, "vm")
		os.Chmod(img, 0o644)
		mnt := cliMkdir(t, d, "mnt")
		emptyBin := cliMkdir(t, d, "bin")
		cliCleanup(t, mnt)
		for _, args := range [][]string{{"mount", src, mnt}, {src, mnt, "-o", "ro"}} {
			cmd := exec.Command(setpriv, append([]string{"--reuid=" + nobody.Uid, "--regid=" + nobody.Gid, "--clear-groups", bin}, args...)...)
			cmd.Env = []string{"PATH=" + emptyBin}
			r := cliRunCmd(t, cmd)
			cliWantError(t, "qcowfs "+strings.Join(args, " ")+" as nobody", r, "fusermount3")
			if m := cliMountsUnder(t, d); len(m) != 0 {
				t.Errorf("mounted: %v", m)
			}
			if p := cliDaemons(t, mnt); len(p) != 0 {
				t.Errorf("qcowfs processes left: %v", p)
			}
		}
	})
}
