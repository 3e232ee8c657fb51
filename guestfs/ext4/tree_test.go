package ext4

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"testing/fstest"
	"unicode/utf8"

	"github.com/qcowfs/qcowfs/guestfs"
	"github.com/qcowfs/qcowfs/guestfs/guesttest"
)

// An imageCase is a way of making an image of a source tree.
type imageCase struct {
	name string
	tree *tree
	// mkfs's arguments besides -d TREE.
	mkfs []string
	// kernel: mkfs makes an empty file system and the kernel's mount
	// fills it (cp -a), so the tree's times, htree directories and
	// extents are the kernel's; with mkfs -d they are e2fsprogs'.
	kernel bool
	// indexD: e2fsck -fD indexes every directory of more than a block
	// (mkfs -d leaves them linear).
	indexD bool
	typ    string // what blkid calls it
	// mkfsLoses lists files mkfs.ext4 -d does not copy faithfully:
	// e2fsprogs' own debugfs must show them as this package does, and
	// not as the source has them.
	mkfsLoses []string
}

var imageCases = []imageCase{
	{name: "ext4", tree: fullTree, mkfs: []string{"-b", "4096"}, typ: "ext4"},
	{name: "ext4-htree", tree: fullTree, mkfs: []string{"-b", "4096"}, indexD: true, typ: "ext4"},
	{name: "ext4-1k", tree: smallTree, mkfs: []string{"-b", "1024"}, indexD: true, typ: "ext4"},
	{name: "ext4-kernel", tree: timesTree, mkfs: []string{"-b", "4096"}, kernel: true, typ: "ext4"},
	// mke2fs 1.47.0 -d -O inline_data cuts a file whose last block is
	// a hole at its last data block.
	{name: "ext4-inline", tree: mediumTree, mkfs: []string{"-b", "4096", "-O", "inline_data"}, indexD: true, typ: "ext4", mkfsLoses: []string{"sparse/hole-first", guesttest.UnwrittenFile}},
	{name: "ext4-inline-kernel", tree: timesTree, mkfs: []string{"-b", "4096", "-O", "inline_data"}, kernel: true, typ: "ext4"},
	{name: "ext3", tree: mediumTree, mkfs: []string{"-t", "ext3", "-b", "4096"}, indexD: true, typ: "ext3"},
	{name: "ext2", tree: mediumTree, mkfs: []string{"-t", "ext2", "-b", "4096"}, typ: "ext2"},
	{name: "ext2-1k-kernel", tree: timesTree1K, mkfs: []string{"-t", "ext2", "-b", "1024"}, kernel: true, typ: "ext2"},
	// meta_bg across many groups (the kernel spreads the inodes),
	// csum_seed, large_dir, sparse_super2.
	{name: "ext4-features-1k-kernel", tree: timesTree1K, mkfs: []string{"-b", "1024", "-O", "meta_bg,^resize_inode,metadata_csum_seed,large_dir,sparse_super2"}, kernel: true, typ: "ext4"},
	// Group descriptors of 32 bytes with CRC-16 checksums.
	{name: "ext4-gdt-csum", tree: mediumTree, mkfs: []string{"-b", "4096", "-O", "^metadata_csum,uninit_bg,^64bit"}, indexD: true, typ: "ext4"},
	{name: "ext4-bigalloc", tree: mediumTree, mkfs: []string{"-b", "4096", "-O", "bigalloc", "-C", "16384"}, indexD: true, typ: "ext4"},
	{name: "big-ext4", tree: bigTree, mkfs: []string{"-b", "4096"}, typ: "ext4"},
	// 1 KiB blocks: the 300 MiB file reaches into triple indirect blocks.
	{name: "big-ext2-1k", tree: bigTree, mkfs: []string{"-t", "ext2", "-b", "1024"}, typ: "ext2"},
}

// makeImage makes c's image of its tree.
func (c imageCase) makeImage(t *testing.T) (img, src string) {
	t.Helper()
	src = c.tree.path(t)
	img = filepath.Join(t.TempDir(), "fs.img")
	command(t, "cp", "--sparse=always", c.madeImage(t), img)
	if c.indexD {
		requireTools(t, "e2fsck")
		// Exit status 1: it changed the file system (the indexes).
		if out, errOut, err := commandErr("e2fsck", "-fyD", img); err != nil && !isExit(err, 1) {
			t.Fatalf("e2fsck -fyD: %v\n%s%s", err, out, errOut)
		}
	}
	requireTools(t, "e2fsck")
	if out, errOut, err := commandErr("e2fsck", "-fn", img); err != nil {
		t.Fatalf("e2fsck -fn says the image is not clean: %v\n%s%s", err, out, errOut)
	}
	return img, src
}

// madeImages are the images mkfs (and the kernel) made of each tree, by
// tree, mkfs arguments and kernel: made once, copied for each case.
var (
	madeMu     sync.Mutex
	madeImages = map[string]*madeImage{}
)

type madeImage struct {
	once sync.Once
	path string
}

func (c imageCase) madeImage(t testing.TB) string {
	t.Helper()
	key := fmt.Sprintf("%p %q %v", c.tree, c.mkfs, c.kernel)
	madeMu.Lock()
	m := madeImages[key]
	if m == nil {
		m = &madeImage{}
		madeImages[key] = m
	}
	madeMu.Unlock()
	m.once.Do(func() {
		src := c.tree.path(t)
		const size = 1 << 30 // sparse: only what mkfs and the tree write is allocated
		f, err := os.CreateTemp(treeDir, "image-*.img")
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
		img := f.Name()
		if !c.kernel {
			mkfsAt(t, img, size, append(c.mkfs, "-d", src)...)
		} else {
			mkfsAt(t, img, size, c.mkfs...)
			mnt, unmount := mountImage(t, img, "rw")
			command(t, "cp", "-a", src+"/.", mnt)
			// cp writes zeros or leaves holes: make unwritten extents.
			guesttest.WriteUnwritten(t, filepath.Join(mnt, guesttest.UnwrittenFile))
			command(t, "touch", "-r", filepath.Join(src, guesttest.UnwrittenFile), filepath.Join(mnt, guesttest.UnwrittenFile))
			unmount()
		}
		m.path = img
	})
	if m.path == "" {
		t.Fatal("the image could not be made")
	}
	return m.path
}

// debugfsSize is the size debugfs gives file p of img.
func debugfsSize(t *testing.T, img, p string) int64 {
	t.Helper()
	out := command(t, "debugfs", "-R", "stat /"+p, img)
	m := regexp.MustCompile(`Size: (\d+)`).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("debugfs stat %s: no size in\n%s", p, out)
	}
	n, _ := strconv.ParseInt(m[1], 10, 64)
	return n
}

func isExit(err error, code int) bool {
	var ee interface{ ExitCode() int }
	return errors.As(err, &ee) && ee.ExitCode() == code
}

// TestTrees reads every image of every tree and compares it with the
// source tree (bytes, size, mode, owner, mtime, link targets, entries,
// which names are one file) and with the kernel's loop mount of the same
// image (all of stat: inode numbers, link counts, st_blocks, every time to
// the nanosecond; and where SEEK_DATA and SEEK_HOLE find data), then runs
// testing/fstest over its io/fs view.
func TestTrees(t *testing.T) {
	requireTools(t, "mkfs.ext4", "blkid")
	for _, c := range imageCases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			if testing.Short() && c.tree != mediumTree && c.tree != smallTree {
				t.Skip("-short: only the trees without the 10,000-entry folder and the big files")
			}
			img, src := c.makeImage(t)
			if c.kernel && c.tree != bigTree && !strings.Contains(strings.Join(c.mkfs, " "), "ext2") {
				if out := command(t, "debugfs", "-R", "ex "+guesttest.UnwrittenFile, img); !strings.Contains(out, "Uninit") {
					t.Fatalf("%s has no unwritten extents (debugfs ex):\n%s", guesttest.UnwrittenFile, out)
				}
			}
			if got := strings.TrimSpace(command(t, "blkid", "-p", "-o", "value", "-s", "TYPE", img)); got != c.typ {
				t.Fatalf("blkid calls the image %q, want %q", got, c.typ)
			}
			fsys := openImage(t, img)
			if fsys.Type() != c.typ {
				t.Errorf("Type() = %q, blkid says %q", fsys.Type(), c.typ)
			}
			got := guesttest.ReadFS(t, fsys, "lost+found")

			want := guesttest.Source
			if c.kernel {
				want |= guesttest.Mtime
			} else {
				want |= guesttest.MtimeSec
			}
			source := guesttest.ReadOS(t, src)
			// The root is mkfs's (or the kernel's), not the source's.
			source["."] = got["."]
			kept := maps.Clone(got)
			for _, p := range c.mkfsLoses {
				if size := debugfsSize(t, img, p); size != got[p].Size || size == source[p].Size {
					t.Errorf("%s: debugfs says %d bytes, this package %d, the source %d", p, size, got[p].Size, source[p].Size)
				}
				delete(source, p)
				delete(kept, p)
			}
			guesttest.Compare(t, "against the source tree", kept, source, want)

			if os.Geteuid() == 0 || os.Getenv("CI") == "true" {
				mnt, _ := mountImage(t, img, "ro")
				guesttest.Compare(t, "against the kernel's mount", got, guesttest.ReadOS(t, mnt, "lost+found"), guesttest.Kernel)
			}

			if err := fstest.TestFS(hideUnopenable(fsys), "files/size-4096", "links/absolute", "deep/d01/d02"); err != nil {
				t.Error(err)
			}
			// What fstest cannot open: links that lead nowhere.
			for name, want := range map[string]error{"links/loop1": syscall.ELOOP, "links/self": syscall.ELOOP, "links/dangling": fs.ErrNotExist} {
				if _, err := fsys.Open(name); !errors.Is(err, want) {
					t.Errorf("Open(%s) = %v, want %v", name, err, want)
				}
			}
		})
	}
}

// hideUnopenable hides from fstest.TestFS what it cannot take of a tree
// (it opens every entry, following links, and refuses names with a
// backslash): the symbolic links that lead nowhere, names that io/fs
// cannot carry (not UTF-8) and names with a backslash; and the 300 MiB
// and 4 GiB files, which iotest.TestReader would read one to three bytes
// a call (two minutes of CPU for the first). Those are compared with the source and the kernel
// through the inode calls (ReadFS).
func hideUnopenable(fsys *FS) fs.FS {
	hidden := func(name string) bool {
		base := path.Base(name)
		return slices.Contains(guesttest.Dangling, name) || name == guesttest.BigFile || name == guesttest.HugeFile || strings.Contains(base, `\`) || !utf8.ValidString(base)
	}
	return &hideFS{fsys: fsys, hidden: hidden}
}

type hideFS struct {
	fsys   *FS
	hidden func(string) bool
}

func (h *hideFS) Open(name string) (fs.File, error) {
	if h.hidden(name) {
		return nil, &fs.PathError{Op: "open", Path: name, Err: fs.ErrNotExist}
	}
	f, err := h.fsys.Open(name)
	if d, ok := f.(fs.ReadDirFile); ok && err == nil {
		return &hideDir{ReadDirFile: d, h: h, dir: name}, nil
	}
	return f, err
}

func (h *hideFS) filter(dir string, list []fs.DirEntry) []fs.DirEntry {
	return slices.DeleteFunc(list, func(e fs.DirEntry) bool { return h.hidden(path.Join(dir, e.Name())) })
}

func (h *hideFS) ReadDir(name string) ([]fs.DirEntry, error) {
	list, err := h.fsys.ReadDir(name)
	return h.filter(name, list), err
}

func (h *hideFS) Stat(name string) (fs.FileInfo, error) {
	if h.hidden(name) {
		return nil, &fs.PathError{Op: "stat", Path: name, Err: fs.ErrNotExist}
	}
	return h.fsys.Stat(name)
}

func (h *hideFS) Lstat(name string) (fs.FileInfo, error) {
	if h.hidden(name) {
		return nil, &fs.PathError{Op: "lstat", Path: name, Err: fs.ErrNotExist}
	}
	return h.fsys.Lstat(name)
}

func (h *hideFS) ReadLink(name string) (string, error) {
	if h.hidden(name) {
		return "", &fs.PathError{Op: "readlink", Path: name, Err: fs.ErrNotExist}
	}
	return h.fsys.ReadLink(name)
}

type hideDir struct {
	fs.ReadDirFile
	h   *hideFS
	dir string
}

func (d *hideDir) ReadDir(n int) ([]fs.DirEntry, error) {
	for {
		list, err := d.ReadDirFile.ReadDir(n)
		kept := d.h.filter(d.dir, list)
		// A chunk that was all hidden: read on, as if it had not been.
		if len(kept) == 0 && len(list) > 0 && n > 0 && err == nil {
			continue
		}
		return kept, err
	}
}

var _ guestfs.FS = (*FS)(nil)

// TestConcurrent reads one file system from eight goroutines at once,
// through a cache small enough to evict all the time: every reader must
// see the same tree (and `go test -race` must find no race).
func TestConcurrent(t *testing.T) {
	c := imageCase{tree: mediumTree, mkfs: []string{"-b", "4096", "-O", "inline_data"}}
	img := c.madeImage(t)
	f, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() }) // after the parallel subtests
	st, _ := f.Stat()
	fsys, err := OpenOptions(f, st.Size(), Options{CacheBytes: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	want := guesttest.ReadFS(t, fsys, "lost+found")
	for i := range 8 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			t.Parallel()
			guesttest.Compare(t, "a concurrent reader", guesttest.ReadFS(t, fsys, "lost+found"), want, guesttest.Kernel)
		})
	}
}
