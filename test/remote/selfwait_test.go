package remote

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
	"github.com/qcowfs/qcowfs/test/servers"
)

// TestRemoteOwnFoldersInsideMount: the disk cache (--cache-dir), and the
// throwaway overlays' folder ($TMPDIR with --overlay=temp), of a mount of
// an image on nginx, inside the mount point: refused at once, in one line
// naming the flag, nothing mounted, no daemon left, the folder not made.
// Before, the mount returned 0 after 10 s and every access to it hung
// (the daemon stored chunks in its own mount while a scan of it waited).
// The same folders outside the mount point work: the image reads back as
// qemu reads it.
func TestRemoteOwnFoldersInsideMount(t *testing.T) {
	root := harness.SourceDir(t)
	img := qemu.Make(t, filepath.Join(root, "vm.qcow2"), "8M", "write -P 0x5a 0 1M")
	want := wantRaw(t, t.TempDir(), img)
	ng := servers.StartNginx(t, root, false)
	url := ng.URL + "/vm.qcow2"
	for _, c := range []struct {
		name, flag string
		args       func(mnt string) ([]string, []string) // flags, environment
	}{
		{"cache dir", "--cache-dir", func(mnt string) ([]string, []string) {
			return []string{"--cache-dir", filepath.Join(mnt, "cache"), "--hydrate"}, nil
		}},
		{"temp overlays", "--overlay=temp", func(mnt string) ([]string, []string) {
			return []string{"--writable", "--overlay=temp"}, []string{"TMPDIR=" + filepath.Join(mnt, "tmp")}
		}},
	} {
		t.Run(strings.ReplaceAll(c.name, " ", "_"), func(t *testing.T) {
			mnt := t.TempDir()
			if err := os.Mkdir(filepath.Join(mnt, "tmp"), 0o755); err != nil {
				t.Fatal(err)
			}
			harness.Cleanup(t, mnt)
			flags, env := c.args(mnt)
			args := append(append(append([]string{"mount", "--log-file", filepath.Join(t.TempDir(), "log")}, remoteFlags...), flags...), url, mnt)
			cmd := exec.Command(harness.Bin(), args...)
			cmd.Env = append(os.Environ(), env...)
			r := harness.RunCmdTimeout(t, cmd, 20*time.Second)
			harness.WantError(t, "qcowfs "+strings.Join(args, " "), r, c.flag, "inside the mount point")
			if m := harness.MountAt(t, mnt); m != nil {
				// (Its folder is not read: it may hang.)
				t.Fatalf("mounted: %+v", m)
			}
			if p := harness.Daemons(t, mnt); len(p) != 0 {
				t.Errorf("qcowfs processes left: %v", p)
			}
			if names := harness.Names(t, mnt); len(names) != 1 || names[0] != "tmp" {
				t.Errorf("the mount point holds %v, want only tmp", names)
			}
			if names := harness.Names(t, filepath.Join(mnt, "tmp")); len(names) != 0 {
				t.Errorf("made %v in the mount point's tmp", names)
			}

			// Outside the mount point, the same flags work.
			out := t.TempDir()
			if err := os.Mkdir(filepath.Join(out, "tmp"), 0o700); err != nil {
				t.Fatal(err)
			}
			flags, env = c.args(out)
			m := harness.Daemon{Env: env}.Mount(t, url, append(append([]string{"--read-ahead=0"}, remoteFlags...), flags...)...)
			got := filepath.Join(t.TempDir(), "vm.raw")
			harness.WantOK(t, "cp", harness.Exec(t, "cp", filepath.Join(m.Dir, "vm.raw"), got))
			harness.SameFile(t, got, want)
		})
	}
}
