package ext4

import (
	"errors"
	"flag"
	"fmt"
	"io"
	iofs "io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/guestfs"
	"github.com/qcowfs/qcowfs/guestfs/guesttest"
)

// The fuzz targets take whole images (guesttest.EncodeSparse), made by
// mkfs.ext4 for the seeds: small (2 MiB, 1 KiB blocks, no journal) and
// mostly without metadata_csum, so that mutations reach the structures
// behind the checksums. Each exercises one part from its own entry:
// FuzzSuperblock the superblock's checks, FuzzImage opening and reading
// everything (group descriptors, inode tables, extent trees, block maps,
// directories), FuzzInode one inode's mapping and contents, FuzzDir one
// directory's entries and lookups (linear, hashed, inline).
//
// Whatever the bytes: no panic, no read outside the image, a bounded
// amount read, and every error a FormatError (ErrCorrupt),
// ErrUnsupported, or what the io/fs and inode calls answer for a name
// (ErrNotExist, ENOTDIR, ELOOP, EISDIR, EINVAL).

type fuzzSeed struct {
	data []byte // EncodeSparse's format
	size int64
}

var fuzzSeedArgs = [][]string{
	{"-b", "1024", "-O", "^metadata_csum,^has_journal"},
	{"-b", "1024", "-O", "^has_journal"},
	{"-t", "ext2", "-b", "1024"},
	{"-b", "1024", "-O", "^metadata_csum,^has_journal,inline_data"},
	{"-b", "4096", "-O", "^metadata_csum,^has_journal"},
}

// fuzzSeeds makes the seed images, or none if e2fsprogs is missing (the
// targets then start from their plain seeds). Fuzz workers get their
// inputs from the coordinating process, never from f.Add, so they skip
// making them.
func fuzzSeeds(f *testing.F) []fuzzSeed {
	if w := flag.Lookup("test.fuzzworker"); w != nil && w.Value.String() == "true" {
		return nil
	}
	for _, tool := range []string{"mkfs.ext4", "e2fsck"} {
		if _, err := exec.LookPath(tool); err != nil {
			return nil
		}
	}
	src := f.TempDir()
	write := func(name string, b []byte) {
		if err := os.WriteFile(filepath.Join(src, name), b, 0o644); err != nil {
			f.Fatal(err)
		}
	}
	write("empty", nil)
	write("small", []byte("hello"))
	write("seventy", []byte(strings.Repeat("seventy!", 9)))
	// Blocks at 0, 100 KiB and 300 KiB: single and double indirect
	// blocks with 1 KiB blocks; six runs: an extent block of its own.
	for name, offs := range map[string][]int64{"big": {0, 100 << 10, 300 << 10}, "sparse": {0, 20 << 10, 40 << 10, 60 << 10, 80 << 10, 100 << 10}} {
		sp, err := os.Create(filepath.Join(src, name))
		if err != nil {
			f.Fatal(err)
		}
		for i, off := range offs {
			sp.WriteAt([]byte(fmt.Sprintf("%s run %d", name, i)), off)
		}
		sp.Close()
	}
	os.Symlink("small", filepath.Join(src, "fast"))
	os.Symlink(strings.Repeat("./", 40)+"small", filepath.Join(src, "slow"))
	os.Link(filepath.Join(src, "small"), filepath.Join(src, "hard"))
	os.Mkdir(filepath.Join(src, "dir"), 0o755)
	for i := range 80 {
		os.WriteFile(filepath.Join(src, "dir", fmt.Sprintf("entry-%02d", i)), nil, 0o644)
	}
	var seeds []fuzzSeed
	for _, args := range fuzzSeedArgs {
		img := filepath.Join(f.TempDir(), "img")
		if err := os.WriteFile(img, nil, 0o644); err != nil {
			f.Fatal(err)
		}
		os.Truncate(img, 2<<20)
		if out, err := exec.Command("mkfs.ext4", append(append([]string{"-q", "-F", "-N", "128", "-d", src}, args...), img)...).CombinedOutput(); err != nil {
			f.Fatalf("mkfs.ext4 %v: %v\n%s", args, err, out)
		}
		exec.Command("e2fsck", "-fyD", img).Run() // hash-index dir
		b, err := os.ReadFile(img)
		if err != nil {
			f.Fatal(err)
		}
		seeds = append(seeds, fuzzSeed{data: guesttest.EncodeSparse(b), size: int64(len(b))})
	}
	return seeds
}

// fuzzTimeLimit bounds the time one input may take: past it, the fuzz
// worker panics, and the fuzzer keeps the input as a failure (it has no
// time limit of its own, and a hang stalls it silently).
const fuzzTimeLimit = 10 * time.Second

// fuzzOpen opens an image decoded from the fuzzer's input; the time from
// then to the end of the test is bounded by fuzzTimeLimit.
func fuzzOpen(t *testing.T, data []byte, size int64) (*FS, *guesttest.SparseDisk) {
	timer := time.AfterFunc(fuzzTimeLimit, func() {
		panic(fmt.Sprintf("%s: one input took more than %v", t.Name(), fuzzTimeLimit))
	})
	t.Cleanup(func() { timer.Stop() })
	d := guesttest.DecodeSparse(data, size)
	fsys, err := OpenOptions(d, d.Size(), Options{CacheBytes: 256 << 10})
	if err != nil {
		checkFuzzErr(t, err)
		return nil, d
	}
	return fsys, d
}

// checkFuzzErr fails the test on an error no reader of any image should
// return.
func checkFuzzErr(t *testing.T, err error) {
	t.Helper()
	if err == nil || err == io.EOF {
		return
	}
	for _, ok := range []error{guestfs.ErrCorrupt, guestfs.ErrUnsupported, iofs.ErrNotExist, iofs.ErrInvalid,
		syscall.ENOTDIR, syscall.ELOOP, syscall.EISDIR, syscall.EINVAL} {
		if errors.Is(err, ok) {
			return
		}
	}
	t.Fatalf("an error of no expected kind: %v", err)
}

// checkFuzzDisk fails the test if reading went outside the image or read
// more than a bounded amount.
func checkFuzzDisk(t *testing.T, d *guesttest.SparseDisk) {
	t.Helper()
	if err := d.Outside(); err != nil {
		t.Fatal(err)
	}
	if max := 64*d.Size() + 64<<20; d.Read.Load() > max {
		t.Fatalf("read %d bytes of a %d-byte image", d.Read.Load(), d.Size())
	}
}

// fuzzFile reads a regular file's first 64 KiB and a little at its end,
// and walks its data runs (at most 64).
func fuzzFile(t *testing.T, fsys *FS, ino uint64) {
	f, err := fsys.OpenIno(ino)
	if err != nil {
		checkFuzzErr(t, err)
		return
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 64<<10)
	_, err = f.ReadAt(b, 0)
	checkFuzzErr(t, err)
	if n := st.Size(); n > 10 {
		_, err = f.ReadAt(b[:10], n-10)
		checkFuzzErr(t, err)
	}
	off := int64(0)
	for range 64 {
		d, err := f.NextData(off)
		if err != nil {
			checkFuzzErr(t, err)
			break
		}
		h, err := f.NextHole(d)
		if err != nil {
			checkFuzzErr(t, err)
			break
		}
		if d < off || h <= d {
			t.Fatalf("NextData(%d) = %d, NextHole(%d) = %d", off, d, d, h)
		}
		off = h
	}
}

// fuzzWalk reads every directory once, every file a little, every link.
func fuzzWalk(t *testing.T, fsys *FS) {
	seen := map[uint64]bool{}
	todo := []uint64{RootIno}
	for len(todo) > 0 && len(seen) < 1000 {
		dir := todo[0]
		todo = todo[1:]
		if seen[dir] {
			continue
		}
		seen[dir] = true
		list, err := fsys.ReadDirIno(dir)
		checkFuzzErr(t, err)
		for _, e := range list {
			st, err := fsys.Lookup(dir, e.Name)
			if err != nil {
				checkFuzzErr(t, err)
				continue
			}
			switch st.Mode & syscall.S_IFMT {
			case syscall.S_IFDIR:
				todo = append(todo, st.Ino)
			case syscall.S_IFLNK:
				_, err := fsys.ReadLinkIno(st.Ino)
				checkFuzzErr(t, err)
			default:
				fuzzFile(t, fsys, st.Ino)
			}
		}
	}
}

func addImageSeeds(f *testing.F, add func(s fuzzSeed)) {
	for _, s := range fuzzSeeds(f) {
		add(s)
	}
}

// FuzzSuperblock parses arbitrary superblocks of partitions of arbitrary
// sizes; a superblock it accepts must describe a file system that fits.
func FuzzSuperblock(f *testing.F) {
	addImageSeeds(f, func(s fuzzSeed) {
		d := guesttest.DecodeSparse(s.data, s.size)
		b := make([]byte, superblockSize)
		d.ReadAt(b, superblockOffset)
		f.Add(b, s.size)
	})
	f.Add(make([]byte, superblockSize), int64(1<<20))
	f.Fuzz(func(t *testing.T, b []byte, size int64) {
		sb, err := ParseSuperblock(b, size)
		if err != nil {
			checkFuzzErr(t, err)
			return
		}
		bs := uint64(sb.BlockSize)
		switch {
		case bs < 1024 || bs > 65536 || bs&(bs-1) != 0:
			t.Fatalf("block size %d", bs)
		case sb.BlocksCount == 0 || size < 0 || sb.BlocksCount > uint64(size)/bs:
			t.Fatalf("%d blocks of %d bytes in a %d-byte partition", sb.BlocksCount, bs, size)
		case uint64(sb.Groups)*uint64(sb.InodesPerGroup) != uint64(sb.InodesCount) || sb.Groups == 0:
			t.Fatalf("%d groups of %d inodes, %d inodes", sb.Groups, sb.InodesPerGroup, sb.InodesCount)
		case uint32(sb.InodeSize) > sb.BlockSize || sb.InodeSize < 128 || sb.descPerBlock == 0:
			t.Fatalf("inode size %d, %d descriptors a block", sb.InodeSize, sb.descPerBlock)
		}
	})
}

// FuzzImage opens arbitrary images and reads all of them it can.
func FuzzImage(f *testing.F) {
	addImageSeeds(f, func(s fuzzSeed) { f.Add(s.data, s.size) })
	f.Add([]byte{}, int64(1<<20))
	f.Fuzz(func(t *testing.T, data []byte, size int64) {
		fsys, d := fuzzOpen(t, data, size)
		if fsys != nil {
			fuzzWalk(t, fsys)
			iofs.WalkDir(fsys, ".", func(p string, e iofs.DirEntry, err error) error {
				checkFuzzErr(t, err)
				return nil
			})
		}
		checkFuzzDisk(t, d)
	})
}

// FuzzInode reads one inode of arbitrary images every way there is.
func FuzzInode(f *testing.F) {
	addImageSeeds(f, func(s fuzzSeed) {
		for _, ino := range []uint32{2, 12, 13, 14, 15, 16, 17, 18, 19} {
			f.Add(s.data, s.size, ino)
		}
	})
	f.Fuzz(func(t *testing.T, data []byte, size int64, ino uint32) {
		fsys, d := fuzzOpen(t, data, size)
		if fsys != nil {
			_, err := fsys.StatIno(uint64(ino))
			checkFuzzErr(t, err)
			fuzzFile(t, fsys, uint64(ino))
			_, err = fsys.ReadLinkIno(uint64(ino))
			checkFuzzErr(t, err)
			_, err = fsys.ReadDirIno(uint64(ino))
			checkFuzzErr(t, err)
		}
		checkFuzzDisk(t, d)
	})
}

// FuzzDir lists one directory of arbitrary images and looks a name up
// in it, through its index, its entries, and a path.
func FuzzDir(f *testing.F) {
	addImageSeeds(f, func(s fuzzSeed) {
		for _, c := range []struct {
			ino  uint32
			name string
		}{{2, "small"}, {2, "dir"}, {2, ".."}, {2, "absent"}, {20, "entry-42"}, {20, "entry-99"}, {21, "entry-07"}} {
			f.Add(s.data, s.size, c.ino, c.name)
		}
	})
	f.Fuzz(func(t *testing.T, data []byte, size int64, ino uint32, name string) {
		fsys, d := fuzzOpen(t, data, size)
		if fsys != nil {
			_, err := fsys.ReadDirIno(uint64(ino))
			checkFuzzErr(t, err)
			_, err = fsys.Lookup(uint64(ino), name)
			checkFuzzErr(t, err)
			if dir, err := fsys.readInode(uint64(ino)); err == nil && dir.isDir() {
				_, _, _, err := fsys.lookupDx(dir, name)
				checkFuzzErr(t, err)
				_, _, err = fsys.lookupLinear(dir, name)
				checkFuzzErr(t, err)
			}
			if iofs.ValidPath("dir/" + name) {
				_, err = fsys.Stat("dir/" + name)
				checkFuzzErr(t, err)
			}
		}
		checkFuzzDisk(t, d)
	})
}
