package write

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestShownReadOnly: the images a writable mount shows read-only say so
// where the images it does not show do: one line each on the mount's
// stderr, "shown read-only: PATH: why (what to do)", and per image in
// qcowfs status, human and JSON. The reasons: a backing file of another
// image (validated before its overlay, and after it), a persistent bitmap
// left in use by a writer killed with -9 (qemu-img info says in-use),
// qemu's legacy AES encryption. A writable image says nothing. Each such
// image refuses an open for writing (EROFS). What the line says to do
// works, with qemu as the judge: after qemu-img bitmap --remove the image
// is writable, and with --overlay no image is read-only. Before, only
// the log said any of this.
func TestShownReadOnly(t *testing.T) {
	src := harness.SourceDir(t)
	img := func(name string) string { return filepath.Join(src, name) }
	qemu.Create(t, "qcow2", img("plain.qcow2"), "4M")
	// base.qcow2 is validated before top.qcow2; zbase.qcow2 after
	// atop.qcow2.
	qemu.Create(t, "qcow2", img("base.qcow2"), "4M")
	qemu.Create(t, "qcow2", img("top.qcow2"), "4M", "-b", "base.qcow2", "-F", "qcow2")
	qemu.Create(t, "qcow2", img("zbase.qcow2"), "4M")
	qemu.Create(t, "qcow2", img("atop.qcow2"), "4M", "-b", "zbase.qcow2", "-F", "qcow2")
	// A bitmap left in use: qemu-io has it open for writing (which
	// marks the bitmap in use) when it is killed.
	inUse := img("inuse.qcow2")
	qemu.Create(t, "qcow2", inUse, "4M")
	qemu.Img(t, "bitmap", "--add", inUse, "daily")
	io := exec.Command("qemu-io", inUse, "-c", "write 0 64k", "-c", "sleep 60000")
	if err := io.Start(); err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, "qemu-io to mark the bitmap in use", 10*time.Second, func() bool {
		out, _ := exec.Command("qemu-img", "info", "-U", inUse).Output()
		return strings.Contains(string(out), "in-use")
	})
	io.Process.Kill()
	io.Wait()
	if out, _ := exec.Command("qemu-img", "info", inUse).Output(); !strings.Contains(string(out), "in-use") {
		t.Fatalf("qemu-img info does not show the bitmap in use:\n%s", out)
	}
	key := filepath.Join(t.TempDir(), "key")
	if err := os.WriteFile(key, []byte("pass-aes"), 0o600); err != nil {
		t.Fatal(err)
	}
	qemu.Img(t, "create", "-q", "-f", "qcow2", "--object", "secret,id=s0,file="+key, "-o", "encrypt.format=aes,encrypt.key-secret=s0", img("aes.qcow2"), "4M")

	want := map[string][]string{ // image -> words of its reason
		img("base.qcow2"):  {"backing file of " + img("top.qcow2"), "(write " + img("top.qcow2") + " instead, or mount with --overlay)"},
		img("zbase.qcow2"): {"backing file of " + img("atop.qcow2"), "--overlay)"},
		img("inuse.qcow2"): {`bitmap "daily" is in use`, "(remove it with qemu-img bitmap --remove"},
		img("aes.qcow2"):   {"legacy AES", "(qemu-img convert it to a LUKS-encrypted image to write it)"},
	}
	m := harness.Mount(t, src, "--writable", "--key-file", key)
	var lines []string
	for _, l := range strings.Split(m.Said, "\n") {
		if strings.HasPrefix(l, "qcowfs: shown read-only: ") {
			lines = append(lines, l)
		}
	}
	if len(lines) != len(want) {
		t.Errorf("%d shown read-only lines, want %d:\n%s", len(lines), len(want), m.Said)
	}
	for path, words := range want {
		n := 0
		for _, l := range lines {
			if strings.HasPrefix(l, "qcowfs: shown read-only: "+path+": ") {
				n++
				for _, w := range words {
					if !strings.Contains(l, w) {
						t.Errorf("the line of %s does not say %q: %s", path, w, l)
					}
				}
				if !strings.HasSuffix(l, ")") {
					t.Errorf("the line of %s does not end with what to do: %s", path, l)
				}
			}
		}
		if n != 1 {
			t.Errorf("%s: %d shown read-only lines, want 1:\n%s", path, n, m.Said)
		}
		raw := filepath.Join(m.Dir, strings.TrimSuffix(filepath.Base(path), ".qcow2")+".raw")
		if f, err := os.OpenFile(raw, os.O_WRONLY, 0); !errors.Is(err, syscall.EROFS) {
			t.Errorf("%s opened for writing: %v, want EROFS", raw, err)
			if err == nil {
				f.Close()
			}
		}
	}
	for _, ok := range []string{"plain", "top", "atop"} {
		f, err := os.OpenFile(filepath.Join(m.Dir, ok+".raw"), os.O_WRONLY, 0)
		if err != nil {
			t.Errorf("%s.raw opened for writing: %v", ok, err)
		} else {
			f.Close()
		}
	}
	st, _ := harness.StatusOf(t, m.Dir)
	if len(st.ReadOnly) != len(want) {
		t.Errorf("qcowfs status --output=json lists %d read-only images, want %d: %+v", len(st.ReadOnly), len(want), st.ReadOnly)
	}
	for _, r := range st.ReadOnly {
		if words, ok := want[r.Image]; !ok || !strings.Contains(r.Reason, words[0]) {
			t.Errorf("qcowfs status: %s read-only for %q", r.Image, r.Reason)
		}
	}
	human := harness.Run(t, "status", m.Dir)
	harness.WantOK(t, "qcowfs status", human)
	if !strings.Contains(human.Stdout, "read-only:   4 images\n") {
		t.Errorf("qcowfs status does not count the read-only images:\n%s", human.Stdout)
	}
	for path, words := range want {
		if !strings.Contains(human.Stdout, "  "+path+": ") || !strings.Contains(human.Stdout, words[0]) {
			t.Errorf("qcowfs status does not show %s read-only:\n%s", path, human.Stdout)
		}
	}
	harness.WantUnmount(t, m.Dir)

	// What the lines say to do: the bitmap removed with qemu-img, the
	// image is writable; with --overlay, every image is.
	qemu.Img(t, "bitmap", "--remove", inUse, "daily")
	m = harness.Mount(t, src, "--writable", "--key-file", key)
	if strings.Contains(m.Said, inUse) {
		t.Errorf("after qemu-img bitmap --remove, the mount says:\n%s", m.Said)
	}
	f, err := os.OpenFile(filepath.Join(m.Dir, "inuse.raw"), os.O_WRONLY, 0)
	if err != nil {
		t.Errorf("inuse.raw after qemu-img bitmap --remove: %v", err)
	} else {
		f.Close()
	}
	harness.WantUnmount(t, m.Dir)
	m = harness.Mount(t, src, "--writable", "--overlay", t.TempDir(), "--key-file", key)
	if strings.Contains(m.Said, "shown read-only") {
		t.Errorf("an overlay mount shows images read-only:\n%s", m.Said)
	}
}
