package guestfs_test

import (
	"bytes"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qcowfs/qcowfs/guestfs"
	_ "github.com/qcowfs/qcowfs/guestfs/ext4"
)

// requireTools fails the test under CI=true, and skips it elsewhere, when
// a tool is missing.
func requireTools(t *testing.T, names ...string) {
	t.Helper()
	for _, name := range names {
		if _, err := exec.LookPath(name); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("%s is missing: %v", name, err)
			}
			t.Skipf("%s is missing: %v", name, err)
		}
	}
}

func command(t *testing.T, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s %s: %v\n%s%s", name, strings.Join(args, " "), err, o.String(), e.String())
	}
	return o.String()
}

// TestProbe makes each kind of volume with its own tool and checks that
// Probe names it as blkid (the oracle) does, and that Open opens the ones
// a reader is registered for (ext2/3/4 here; vfat once guestfs/fat is
// imported) and refuses the rest with an error naming the type.
func TestProbe(t *testing.T) {
	requireTools(t, "blkid")
	cases := []struct {
		name  string
		tools []string
		size  int64
		make  func(t *testing.T, img string)
		opens bool
	}{
		{"ext2", []string{"mkfs.ext4"}, 16 << 20, func(t *testing.T, img string) { command(t, "mkfs.ext4", "-q", "-F", "-t", "ext2", img) }, true},
		{"ext3", []string{"mkfs.ext4"}, 16 << 20, func(t *testing.T, img string) { command(t, "mkfs.ext4", "-q", "-F", "-t", "ext3", img) }, true},
		{"ext4", []string{"mkfs.ext4"}, 16 << 20, func(t *testing.T, img string) { command(t, "mkfs.ext4", "-q", "-F", img) }, true},
		{"jbd", []string{"mkfs.ext4"}, 16 << 20, func(t *testing.T, img string) { command(t, "mkfs.ext4", "-q", "-F", "-O", "journal_dev", img) }, false},
		{"vfat", []string{"mkfs.vfat"}, 8 << 20, func(t *testing.T, img string) { command(t, "mkfs.vfat", "-F", "12", img) }, false},
		{"vfat", []string{"mkfs.vfat"}, 32 << 20, func(t *testing.T, img string) { command(t, "mkfs.vfat", "-F", "16", img) }, false},
		{"vfat", []string{"mkfs.vfat"}, 64 << 20, func(t *testing.T, img string) { command(t, "mkfs.vfat", "-F", "32", img) }, false},
		{"swap", []string{"mkswap"}, 16 << 20, func(t *testing.T, img string) { command(t, "mkswap", img) }, false},
		{"xfs", []string{"mkfs.xfs"}, 320 << 20, func(t *testing.T, img string) { command(t, "mkfs.xfs", "-q", "-f", img) }, false},
		{"btrfs", []string{"mkfs.btrfs"}, 128 << 20, func(t *testing.T, img string) { command(t, "mkfs.btrfs", "-q", "-f", img) }, false},
		{"ntfs", []string{"mkntfs"}, 16 << 20, func(t *testing.T, img string) { command(t, "mkntfs", "-q", "-F", "-f", img) }, false},
		{"crypto_LUKS", []string{"qemu-img"}, 0, func(t *testing.T, img string) {
			os.Remove(img)
			command(t, "qemu-img", "create", "-q", "-f", "luks", "--object", "secret,id=s,data=pw", "-o", "key-secret=s,iter-time=10", img, "4M")
		}, false},
	}
	for _, c := range cases {
		t.Run(c.name+"-"+strings.Join(c.tools, ""), func(t *testing.T) {
			requireTools(t, c.tools...)
			img := filepath.Join(t.TempDir(), "img")
			if err := os.WriteFile(img, nil, 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(img, c.size); err != nil {
				t.Fatal(err)
			}
			c.make(t, img)
			if got := strings.TrimSpace(command(t, "blkid", "-p", "-o", "value", "-s", "TYPE", img)); got != c.name {
				t.Fatalf("blkid calls it %q, the case %q", got, c.name)
			}
			f, err := os.Open(img)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			st, _ := f.Stat()
			typ, err := guestfs.Probe(f, st.Size())
			if err != nil || typ != c.name {
				t.Fatalf("Probe = %q, %v; blkid says %q", typ, err, c.name)
			}
			fsys, err := guestfs.Open(f, st.Size())
			if c.opens {
				if err != nil || fsys.Type() != c.name {
					t.Fatalf("Open: %v", err)
				}
				return
			}
			var ue *guestfs.UnsupportedError
			if !errors.As(err, &ue) || ue.Type != c.name || !errors.Is(err, guestfs.ErrUnsupported) || !strings.HasPrefix(err.Error(), c.name+": ") {
				t.Fatalf("Open = %v, want an UnsupportedError naming %s", err, c.name)
			}
		})
	}
}

// TestProbeNothing: zeros, random bytes and a device too short to hold a
// superblock are no file system, and a read error is passed on.
func TestProbeNothing(t *testing.T) {
	for name, b := range map[string][]byte{
		"zeros":  make([]byte, 1<<20),
		"short":  make([]byte, 100),
		"random": bytes.Repeat([]byte("qcowfs!\x00"), 1<<17),
	} {
		if typ, err := guestfs.Probe(bytes.NewReader(b), int64(len(b))); !errors.Is(err, guestfs.ErrNoFS) {
			t.Errorf("%s: Probe = %q, %v; want ErrNoFS", name, typ, err)
		}
		if _, err := guestfs.Open(bytes.NewReader(b), int64(len(b))); !errors.Is(err, guestfs.ErrNoFS) {
			t.Errorf("%s: Open: %v; want ErrNoFS", name, err)
		}
	}
	if _, err := guestfs.Probe(failing{}, 1<<20); !errors.Is(err, io.ErrClosedPipe) {
		t.Errorf("Probe over a failing reader: %v", err)
	}
}

type failing struct{}

func (failing) ReadAt([]byte, int64) (int, error) { return 0, io.ErrClosedPipe }
