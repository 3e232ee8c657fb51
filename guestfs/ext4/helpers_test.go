package ext4

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/qcowfs/qcowfs/guestfs/guesttest"
)

// The oracles of these tests are e2fsprogs (mkfs.ext4 -d makes images
// from a source tree; debugfs, dumpe2fs and e2fsck read them) and the
// kernel's own mount of the same image; never a value computed the way
// this package computes it.

// requireTools fails the test under CI=true, and skips it elsewhere, when
// a tool is missing.
func requireTools(t testing.TB, names ...string) {
	t.Helper()
	for _, name := range names {
		if _, err := exec.LookPath(name); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("%s is missing (Debian package e2fsprogs, mount or util-linux): %v", name, err)
			}
			t.Skipf("%s is missing: %v", name, err)
		}
	}
}

// requireRoot fails the test under CI=true, and skips it elsewhere,
// unless it runs as root (loop mounts, owners, device nodes).
func requireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("needs root (loop mounts of images, files of other owners, device nodes); CI runs as root")
		}
		t.Skip("needs root")
	}
}

// command runs a command and returns its standard output; a failure fails the
// test with its standard error.
func command(t testing.TB, name string, args ...string) string {
	t.Helper()
	out, errOut, err := commandErr(name, args...)
	if err != nil {
		t.Fatalf("%s %s: %v\n%s%s", name, strings.Join(args, " "), err, out, errOut)
	}
	return out
}

func commandErr(name string, args ...string) (stdout, stderr string, err error) {
	cmd := exec.Command(name, args...)
	cmd.Env = append(os.Environ(), "LC_ALL=C.UTF-8")
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	err = cmd.Run()
	return o.String(), e.String(), err
}

// A tree is a source folder the tests make images of, made once per test
// binary.
type tree struct {
	once sync.Once
	dir  string
	opts guesttest.Options
}

// The trees. mkfs.ext4 -d takes 30 s to make the 10,000-entry folder
// (each entry it adds reads the whole folder again), so only fullTree,
// which two cases share, has it among the trees mkfs reads; the trees
// the kernel copies in have it too.
var (
	treeDir string // under it, the trees; removed by TestMain
	// fullTree is the tree for images of 4 KiB blocks, but for
	// the 300 MiB file and the odd times (mkfs.ext4 -d keeps neither
	// nanoseconds nor times past 2038).
	fullTree = &tree{opts: guesttest.Options{BigDir: 10000, MaxSymlink: 4095}}
	// mediumTree has a folder of 300 entries instead (several blocks).
	mediumTree = &tree{opts: guesttest.Options{BigDir: 300, MaxSymlink: 4095}}
	// smallTree is mediumTree for 1 KiB blocks, which take symbolic link
	// targets of at most 1023 bytes.
	smallTree = &tree{opts: guesttest.Options{BigDir: 300, MaxSymlink: 1023}}
	// timesTree has the 10,000 entries and the odd times, for images the
	// kernel writes; timesTree1K, for 1 KiB blocks.
	timesTree   = &tree{opts: guesttest.Options{BigDir: 10000, MaxSymlink: 4095, Times: true}}
	timesTree1K = &tree{opts: guesttest.Options{BigDir: 10000, MaxSymlink: 1023, Times: true}}
	// bigTree adds the 300 MiB file.
	bigTree = &tree{opts: guesttest.Options{Big: true, MaxSymlink: 1023}}
)

func TestMain(m *testing.M) {
	// In memory where there is a tmpfs: writing the trees' 100,000 files
	// to a disk file system takes minutes on a busy machine, seconds here.
	var err error
	if treeDir, err = os.MkdirTemp("/dev/shm", "ext4-trees-"); err != nil {
		if treeDir, err = os.MkdirTemp("", "ext4-trees-"); err != nil {
			panic(err)
		}
	}
	code := m.Run()
	os.RemoveAll(treeDir)
	os.Exit(code)
}

// path makes the tree (once) and returns its folder.
func (tr *tree) path(t testing.TB) string {
	t.Helper()
	tr.once.Do(func() {
		dir, err := os.MkdirTemp(treeDir, "tree-")
		if err != nil {
			t.Fatal(err)
		}
		o := tr.opts
		o.Owners = os.Geteuid() == 0
		o.Special = os.Geteuid() == 0
		guesttest.Write(t, dir, o)
		// The root of an image is mkfs's, 0755.
		if err := os.Chmod(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		tr.dir = dir
	})
	if tr.dir == "" {
		t.Fatal("the source tree could not be made")
	}
	return tr.dir
}

// mkfs makes an image file of size bytes with mkfs.ext4 and args (-d
// TREE among them, or not), in a test's temporary folder.
func mkfs(t testing.TB, size int64, args ...string) string {
	t.Helper()
	img := filepath.Join(t.TempDir(), "fs.img")
	mkfsAt(t, img, size, args...)
	return img
}

// mkfsAt is mkfs making the image file img.
func mkfsAt(t testing.TB, img string, size int64, args ...string) {
	t.Helper()
	requireTools(t, "mkfs.ext4")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	f.Close()
	command(t, "mkfs.ext4", append(append([]string{"-q", "-F"}, args...), img)...)
}

// mountImage mounts img with the kernel (mount -o opts,loop) until the
// test ends, or until the unmount it returns is called.
func mountImage(t testing.TB, img, opts string) (dir string, unmount func()) {
	t.Helper()
	requireRoot(t)
	requireTools(t, "mount", "umount", "losetup")
	dir = t.TempDir()
	command(t, "mount", "-t", "ext4", "-o", opts+",loop", img, dir)
	done := false
	unmount = func() {
		if !done {
			done = true
			if _, e, err := commandErr("umount", dir); err != nil {
				t.Errorf("umount %s: %v %s; detaching lazily", dir, err, e)
				exec.Command("umount", "-l", dir).Run()
			}
		}
	}
	t.Cleanup(unmount)
	return dir, unmount
}

// openImage opens img with this package.
func openImage(t testing.TB, img string) *FS {
	t.Helper()
	f, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	fsys, err := Open(f, st.Size())
	if err != nil {
		t.Fatalf("Open(%s): %v", img, err)
	}
	return fsys
}
