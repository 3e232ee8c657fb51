package ext4

import (
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/qcowfs/qcowfs/guestfs"
)

// hostileTree is the source of the images the hostile cases damage: a
// small file, a file of block maps or an extent tree with a block of its
// own (six runs with holes between), a folder of two blocks, a hashed
// folder, symbolic links.
func hostileTree(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	check := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	check(os.WriteFile(filepath.Join(dir, "file"), []byte("hello\n"), 0o644))
	big := make([]byte, 200<<10)
	for i := range big {
		big[i] = byte(i * 7)
	}
	check(os.WriteFile(filepath.Join(dir, "big"), big, 0o644))
	f, err := os.Create(filepath.Join(dir, "frag"))
	check(err)
	for i := range 6 {
		_, err := f.WriteAt([]byte(fmt.Sprintf("run %d", i)), int64(i)<<20)
		check(err)
	}
	check(f.Close())
	check(os.Mkdir(filepath.Join(dir, "sub"), 0o755))
	for i := range 200 {
		check(os.WriteFile(filepath.Join(dir, "sub", fmt.Sprintf("entry-%03d", i)), nil, 0o644))
	}
	check(os.Mkdir(filepath.Join(dir, "hashed"), 0o755))
	for i := range 1000 {
		check(os.WriteFile(filepath.Join(dir, "hashed", fmt.Sprintf("name-%04d", i)), nil, 0o644))
	}
	check(os.Symlink("file", filepath.Join(dir, "link")))
	check(os.Symlink(strings.Repeat("./", 50)+"file", filepath.Join(dir, "slowlink")))
	return dir
}

// hostileBase makes an image of the hostile tree with mkfs's args,
// hashed folders indexed (e2fsck -fD).
func hostileBase(t *testing.T, src string, args ...string) string {
	t.Helper()
	img := mkfs(t, 32<<20, append(args, "-d", src)...)
	if _, _, err := commandErr("e2fsck", "-fyD", img); err != nil && !isExit(err, 1) {
		t.Fatalf("e2fsck -fyD: %v", err)
	}
	return img
}

// debugfsNumber finds re's first group in what debugfs says to cmd.
func debugfsNumber(t *testing.T, img, cmd, re string) int64 {
	t.Helper()
	out := command(t, "debugfs", "-R", cmd, img)
	m := regexp.MustCompile(re).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("debugfs %s: no %s in\n%s", cmd, re, out)
	}
	n, err := strconv.ParseInt(m[1], 0, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func inodeOf(t *testing.T, img, p string) uint64 {
	return uint64(debugfsNumber(t, img, "stat "+p, `Inode: (\d+)`))
}

// patch writes b at byte off of img.
func patch(t *testing.T, img string, off int64, b ...byte) {
	t.Helper()
	f, err := os.OpenFile(img, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

// A hostileCase damages an image; reading it must fail with a
// FormatError whose field contains field, for inode ino (0: any), or, if
// unsupported, with an UnsupportedError.
type hostileCase struct {
	name        string
	base        string // "csum": ext4 with metadata_csum; "plain": without; "ext2"
	damage      func(t *testing.T, img string) (ino uint64)
	field       string
	unsupported bool
	// kernelFails: e2fsck misses this damage; the oracle is then that
	// reading this file through the kernel's mount fails.
	kernelFails string
}

var hostileCases = []hostileCase{
	// The superblock, through debugfs, which keeps its checksum right.
	{name: "block size", base: "csum", damage: debugfsDamage("ssv log_block_size 9"), field: "superblock s_log_block_size"},
	{name: "block count past the partition", base: "csum", damage: debugfsDamage("ssv blocks_count 0x100000000"), field: "superblock s_blocks_count"},
	{name: "inode count", base: "csum", damage: debugfsDamage("ssv inodes_count 12345"), field: "superblock s_inodes_count"},
	{name: "inodes per group", base: "csum", damage: debugfsDamage("ssv inodes_per_group 3"), field: "superblock s_inodes_per_group"},
	{name: "descriptor size", base: "csum", damage: debugfsDamage("ssv desc_size 48"), field: "superblock s_desc_size"},
	{name: "first data block", base: "csum", damage: debugfsDamage("ssv first_data_block 7"), field: "superblock s_first_data_block"},
	{name: "revision", base: "csum", damage: debugfsDamage("ssv rev_level 5"), field: "superblock s_rev_level"},
	{name: "unknown feature", base: "csum", damage: debugfsDamage("feature dirdata"), unsupported: true},
	{name: "superblock checksum", base: "csum", damage: func(t *testing.T, img string) uint64 { flipByte(t, img, 1024+0x100); return 0 }, field: "superblock s_checksum"},

	// Group descriptors.
	{name: "inode table outside", base: "csum", damage: debugfsDamage("set_bg 0 inode_table 999999999", "set_bg 0 checksum calc"), field: "group 0 bg_inode_table"},
	{name: "descriptor checksum", base: "csum", damage: func(t *testing.T, img string) uint64 { flipByte(t, img, 4096+0x10); return 0 }, field: "group 0 bg_checksum"},

	// Inodes, through debugfs, which keeps their checksums right.
	{name: "no file type", base: "csum", damage: inodeDamage("/file", "mode 0"), field: "i_mode"},
	{name: "deleted inode", base: "csum", damage: inodeDamage("/file", "links_count 0"), field: "i_links_count"},
	{name: "extra size", base: "csum", damage: inodeDamage("/file", "extra_isize 200"), field: "i_extra_isize"},
	{name: "negative size", base: "csum", damage: inodeDamage("/big", "size 0x8000000000000001"), field: "i_size"},
	{name: "empty symlink", base: "csum", damage: inodeDamage("/link", "size 0"), field: "i_size"},
	{name: "extent count", base: "csum", damage: inodeDamage("/big", "block[0] 0x0005F30A"), field: "extent header eh_entries"},
	{name: "extent magic", base: "csum", damage: inodeDamage("/big", "block[0] 0x1234"), field: "extent header eh_magic"},
	{name: "extent depth", base: "csum", damage: inodeDamage("/big", "block[1] 0x00060004"), field: "extent header eh_depth"},
	{name: "extent outside", base: "csum", damage: inodeDamage("/big", "block[5] 0xFFFFFF00"), field: "extent ee_start"},
	{name: "extent index outside", base: "csum", damage: inodeDamage("/frag", "block[4] 0xFFFFFFF0"), field: "extent index ei_leaf"},
	{name: "inode checksum", base: "csum", damage: func(t *testing.T, img string) uint64 {
		ino := inodeOf(t, img, "/file")
		blk := debugfsNumber(t, img, "imap /file", `located at block (\d+)`)
		off := debugfsNumber(t, img, "imap /file", `offset (0x[0-9a-f]+)`)
		flipByte(t, img, blk*4096+off+0x10) // i_mtime
		return ino
	}, field: "i_checksum"},

	// An extent tree's own block, without checksums, then with.
	{name: "extent block magic", base: "plain", damage: extentBlockDamage(0, 0), field: "extent header eh_magic"},
	{name: "extent block depth (a loop)", base: "plain", damage: extentBlockDamage(6, 1), field: "extent header eh_depth", kernelFails: "frag"},
	{name: "extent block outside", base: "plain", damage: extentBlockDamage(12+8+3, 0xFF), field: "extent ee_start"},
	{name: "extents out of order", base: "plain", damage: extentBlockDamage(24+1, 0), field: "extent ee_block"},
	{name: "extent block checksum", base: "csum", damage: extentBlockDamage(12+8, 0x55), field: "extent block checksum"},

	// Directory blocks.
	{name: "record length zero", base: "plain", damage: dirBlockDamage("/sub", 4, 0, 0), field: "directory entry rec_len"},
	{name: "name past its record", base: "plain", damage: dirBlockDamage("/sub", 6, 200), field: "directory entry name_len"},
	{name: "inode past the count", base: "plain", damage: dirBlockDamage("/sub", 0, 0xFF, 0xFF, 0xFF, 0x7F), field: "directory entry inode"},
	{name: "directory checksum", base: "csum", damage: dirBlockFlip("/sub", 30), field: "directory block checksum"},
	{name: "htree checksum", base: "csum", damage: dirBlockFlip("/hashed", 0x28), field: "htree block checksum"},
	{name: "directory loop", base: "csum", damage: func(t *testing.T, img string) uint64 {
		command(t, "debugfs", "-w", "-R", "ln / /sub/loop", img)
		return inodeOf(t, img, "/sub")
	}, field: "directory entry loop"},

	// Block maps.
	{name: "block pointer outside", base: "ext2", damage: inodeDamage("/big", "block[0] 0xFFFFFF00"), field: "block pointer"},
	{name: "indirect block outside", base: "ext2", damage: inodeDamage("/big", "block[IND] 0xFFFFFF00"), field: "indirect block (level 1)"},
}

func debugfsDamage(cmds ...string) func(t *testing.T, img string) uint64 {
	return func(t *testing.T, img string) uint64 {
		for _, cmd := range cmds {
			command(t, "debugfs", "-w", "-R", cmd, img)
		}
		return 0
	}
}

// inodeDamage sets a field of p's inode with debugfs (set_inode_field),
// which computes the inode's checksum anew.
func inodeDamage(p, set string) func(t *testing.T, img string) uint64 {
	return func(t *testing.T, img string) uint64 {
		ino := inodeOf(t, img, p)
		command(t, "debugfs", "-w", "-R", "sif "+p+" "+set, img)
		return ino
	}
}

// extentBlockDamage writes b at off of /frag's extent tree block.
func extentBlockDamage(off int64, b ...byte) func(t *testing.T, img string) uint64 {
	return func(t *testing.T, img string) uint64 {
		ino := inodeOf(t, img, "/frag")
		blk := debugfsNumber(t, img, "stat /frag", `\(ETB0\):(\d+)`)
		patch(t, img, blk*4096+off, b...)
		return ino
	}
}

// dirBlockDamage writes b at off of folder p's first block.
func dirBlockDamage(p string, off int64, b ...byte) func(t *testing.T, img string) uint64 {
	return func(t *testing.T, img string) uint64 {
		ino := inodeOf(t, img, p)
		blk := debugfsNumber(t, img, "blocks "+p, `^(\d+)`)
		patch(t, img, blk*4096+off, b...)
		return ino
	}
}

// dirBlockFlip inverts the byte at off of folder p's first block.
func dirBlockFlip(p string, off int64) func(t *testing.T, img string) uint64 {
	return func(t *testing.T, img string) uint64 {
		ino := inodeOf(t, img, p)
		flipByte(t, img, debugfsNumber(t, img, "blocks "+p, `^(\d+)`)*4096+off)
		return ino
	}
}

// boundedReader is an image that fails the test on any read outside it,
// and counts the bytes read.
type boundedReader struct {
	t    *testing.T
	r    io.ReaderAt
	size int64
	read atomic.Int64
}

func (b *boundedReader) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 || off+int64(len(p)) > b.size {
		b.t.Errorf("read of %d bytes at %d, outside the image's %d", len(p), off, b.size)
		return 0, io.EOF
	}
	b.read.Add(int64(len(p)))
	return b.r.ReadAt(p, off)
}

// walkAll reads everything of fsys it can, through the inode calls and
// io/fs, and returns every error met. A folder is entered once.
func walkAll(fsys *FS) []error {
	var errs []error
	seen := map[uint64]bool{}
	var walk func(ino uint64, depth int)
	walk = func(ino uint64, depth int) {
		if seen[ino] || depth > 100 {
			return
		}
		seen[ino] = true
		list, err := fsys.ReadDirIno(ino)
		if err != nil {
			errs = append(errs, err)
		}
		for _, e := range list {
			st, err := fsys.Lookup(ino, e.Name)
			if err != nil {
				errs = append(errs, err)
				continue
			}
			switch st.Mode & syscall.S_IFMT {
			case syscall.S_IFDIR:
				walk(e.Ino, depth+1)
			case syscall.S_IFLNK:
				if _, err := fsys.ReadLinkIno(e.Ino); err != nil {
					errs = append(errs, err)
				}
			default:
				f, err := fsys.OpenIno(e.Ino)
				if err != nil {
					errs = append(errs, err)
					continue
				}
				if _, err := io.Copy(io.Discard, io.NewSectionReader(f, 0, min(st.Size, 64<<20))); err != nil {
					errs = append(errs, err)
				}
				if _, err := f.NextHole(0); err != nil && err != io.EOF {
					errs = append(errs, err)
				}
			}
		}
	}
	walk(RootIno, 0)
	iofs.WalkDir(fsys, ".", func(p string, d iofs.DirEntry, err error) error {
		if err != nil {
			errs = append(errs, err)
			return nil
		}
		if d.Type().IsRegular() {
			if _, err := iofs.ReadFile(fsys, p); err != nil {
				errs = append(errs, err)
			}
		}
		return nil
	})
	for _, p := range []string{"sub/loop/file", "link", "slowlink"} {
		if _, err := fsys.Stat(p); err != nil && !errors.Is(err, iofs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errs
}

// TestHostile damages images the way a hostile or broken guest could, one
// structure at a time, with e2fsprogs' tools (debugfs set_super_value,
// set_bg, set_inode_field, ln, which keep checksums right, so that the
// check behind them is reached) or by writing bytes. e2fsck -fn must find
// each damaged (the oracle that the damage is real); reading the image
// must fail with a FormatError naming the field and the inode, read
// nothing outside the image, read a bounded amount, and never panic.
func TestHostile(t *testing.T) {
	requireTools(t, "debugfs", "e2fsck")
	src := hostileTree(t)
	bases := map[string]string{
		"csum":  hostileBase(t, src, "-b", "4096"),
		"plain": hostileBase(t, src, "-b", "4096", "-O", "^metadata_csum"),
		"ext2":  hostileBase(t, src, "-t", "ext2", "-b", "4096"),
	}
	for _, c := range hostileCases {
		t.Run(c.name, func(t *testing.T) {
			img := filepath.Join(t.TempDir(), "img")
			command(t, "cp", "--sparse=always", bases[c.base], img)
			ino := c.damage(t, img)
			if c.kernelFails == "" {
				if _, _, err := commandErr("e2fsck", "-fn", img); err == nil {
					t.Fatal("e2fsck -fn finds nothing wrong: the damage is not what the test means")
				}
			} else {
				mnt, _ := mountImage(t, img, "ro")
				if _, err := os.ReadFile(filepath.Join(mnt, c.kernelFails)); err == nil {
					t.Fatalf("the kernel reads %s: the damage is not what the test means", c.kernelFails)
				}
			}

			f, err := os.Open(img)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			st, _ := f.Stat()
			r := &boundedReader{t: t, r: f, size: st.Size()}
			var errs []error
			fsys, err := Open(r, st.Size())
			if err != nil {
				errs = []error{err}
			} else {
				errs = walkAll(fsys)
			}
			if n := r.read.Load(); n > 4*st.Size() {
				t.Errorf("read %d bytes of a %d-byte image", n, st.Size())
			}
			for _, err := range errs {
				var fe *guestfs.FormatError
				if c.unsupported && errors.Is(err, guestfs.ErrUnsupported) ||
					errors.As(err, &fe) && strings.Contains(fe.Field, c.field) && (ino == 0 || fe.Inode == ino) && errors.Is(err, guestfs.ErrCorrupt) {
					t.Logf("%v", err)
					return
				}
			}
			t.Errorf("no error names %q of inode %d; the errors: %v", c.field, ino, errs)
		})
	}
}

// TestAbsurdSize: a file whose size says 2^62 bytes (e2fsck finds it
// wrong) reads as its data and then zeros, in time that does not grow
// with the size: a read far in, and the search for data past the end of
// its blocks, each map a hole or two.
func TestAbsurdSize(t *testing.T) {
	requireTools(t, "debugfs", "e2fsck")
	for _, args := range [][]string{{"-b", "4096"}, {"-t", "ext2", "-b", "1024"}} {
		t.Run(strings.Join(args, ""), func(t *testing.T) {
			img := hostileBase(t, hostileTree(t), args...)
			command(t, "debugfs", "-w", "-R", "sif /big size 0x4000000000000000", img)
			if _, _, err := commandErr("e2fsck", "-fn", img); err == nil {
				t.Fatal("e2fsck -fn finds nothing wrong")
			}
			f, err := os.Open(img)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			st, _ := f.Stat()
			r := &boundedReader{t: t, r: f, size: st.Size()}
			fsys, err := Open(r, st.Size())
			if err != nil {
				t.Fatal(err)
			}
			file, err := fsys.Open("big")
			if err != nil {
				t.Fatal(err)
			}
			g := file.(guestfs.File)
			if fi, _ := g.Stat(); fi.Size() != 1<<62 {
				t.Fatalf("size %d", fi.Size())
			}
			b := make([]byte, 1<<20)
			before := r.read.Load()
			if n, err := g.ReadAt(b, 1<<61); n != len(b) || err != nil || strings.Trim(string(b), "\x00") != "" {
				t.Fatalf("ReadAt far in: %d, %v", n, err)
			}
			if off, err := g.NextData(200 << 10); err != io.EOF {
				t.Fatalf("NextData past the blocks = %d, %v; want io.EOF", off, err)
			}
			if off, err := g.NextHole(0); err != nil || off != 200<<10 {
				t.Fatalf("NextHole(0) = %d, %v; want the end of the blocks", off, err)
			}
			if n := r.read.Load() - before; n > 64<<10 {
				t.Errorf("read %d bytes of the image for it", n)
			}
		})
	}
}
