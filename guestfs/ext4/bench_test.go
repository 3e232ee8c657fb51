package ext4

import (
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"syscall"
	"testing"
)

// The walk of the benchmarks: 50 folders of 1,000 files of 0 to 599
// bytes (50,000 files, 15 MB), made by mkfs.ext4 -d with the folders
// hash-indexed by e2fsck -fD, as a guest's would be.
const (
	walkDirs  = 50
	walkFiles = 1000
)

var walkImage struct {
	once sync.Once
	path string
}

func makeWalkImage(tb testing.TB) string {
	tb.Helper()
	requireTools(tb, "mkfs.ext4", "e2fsck")
	walkImage.once.Do(func() {
		src, err := os.MkdirTemp(treeDir, "walk-")
		if err != nil {
			tb.Fatal(err)
		}
		content := make([]byte, 600)
		for i := range content {
			content[i] = byte('a' + i%26)
		}
		for d := range walkDirs {
			dir := filepath.Join(src, fmt.Sprintf("d%02d", d))
			if err := os.Mkdir(dir, 0o755); err != nil {
				tb.Fatal(err)
			}
			for f := range walkFiles {
				if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("file-%04d", f)), content[:(d*walkFiles+f)*37%600], 0o644); err != nil {
					tb.Fatal(err)
				}
			}
		}
		img := filepath.Join(treeDir, "walk.img")
		mkfsAt(tb, img, 1<<30, "-b", "4096", "-d", src)
		if _, _, err := commandErr("e2fsck", "-fyD", img); err != nil && !isExit(err, 1) {
			tb.Fatalf("e2fsck -fyD: %v", err)
		}
		walkImage.path = img
	})
	if walkImage.path == "" {
		tb.Fatal("the walk's image could not be made")
	}
	return walkImage.path
}

// walkInodes walks fsys the way a FUSE server answers READDIRPLUS: each
// folder listed, each entry's inode read; with read, every file read
// whole too (tar). It returns the files and bytes seen.
func walkInodes(tb testing.TB, fsys *FS, read bool, each func(files int)) (files int, bytes int64) {
	buf := make([]byte, 128<<10)
	var walk func(dir uint64)
	walk = func(dir uint64) {
		list, err := fsys.ReadDirIno(dir)
		if err != nil {
			tb.Fatal(err)
		}
		for _, e := range list {
			st, err := fsys.StatIno(e.Ino)
			if err != nil {
				tb.Fatal(err)
			}
			files++
			if each != nil {
				each(files)
			}
			if st.Mode&syscall.S_IFMT == syscall.S_IFDIR {
				walk(e.Ino)
				continue
			}
			if read && st.Mode&syscall.S_IFMT == syscall.S_IFREG {
				f, err := fsys.OpenIno(e.Ino)
				if err != nil {
					tb.Fatal(err)
				}
				for off := int64(0); off < st.Size; {
					n, err := f.ReadAt(buf, off)
					if err != nil && err != io.EOF {
						tb.Fatal(err)
					}
					off += int64(n)
					bytes += int64(n)
				}
			}
		}
	}
	walk(RootIno)
	return files, bytes
}

// walkOS walks a kernel mount the same way: each folder listed, each
// entry lstat'ed, with read every file read whole.
func walkOS(tb testing.TB, root string, read bool) (files int, bytes int64) {
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == root {
			return err
		}
		if _, err := d.Info(); err != nil {
			return err
		}
		files++
		if read && d.Type().IsRegular() {
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			bytes += int64(len(b))
		}
		return nil
	})
	if err != nil {
		tb.Fatal(err)
	}
	return files, bytes
}

// BenchmarkWalk walks the 50,000 files (find) and reads them (tar),
// through this package (opened afresh each time: its caches cold, the
// image in the page cache) and through the kernel's loop mount (mounted
// afresh each time: its dentries and inodes cold, the image in the page
// cache), reporting the time per file.
func BenchmarkWalk(b *testing.B) {
	img := makeWalkImage(b)
	f, err := os.Open(img)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	st, _ := f.Stat()
	for _, read := range []bool{false, true} {
		name := map[bool]string{false: "find", true: "tar"}[read]
		b.Run(name+"/ext4", func(b *testing.B) {
			var files int
			var bytes int64
			for b.Loop() {
				fsys, err := Open(f, st.Size())
				if err != nil {
					b.Fatal(err)
				}
				files, bytes = walkInodes(b, fsys, read, nil)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(files), "ns/file")
			b.SetBytes(bytes)
		})
		b.Run(name+"/kernel", func(b *testing.B) {
			requireRoot(b)
			var files int
			var bytes int64
			for b.Loop() {
				b.StopTimer()
				mnt, unmount := mountImage(b, img, "ro")
				b.StartTimer()
				files, bytes = walkOS(b, mnt, read)
				b.StopTimer()
				unmount()
				b.StartTimer()
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(files), "ns/file")
			b.SetBytes(bytes)
		})
	}
}

// BenchmarkReadSmall reads 1,000 small files of one folder, each opened
// and read whole, with the file system's caches warm.
func BenchmarkReadSmall(b *testing.B) {
	img := makeWalkImage(b)
	fsys := openImage(b, img)
	d, err := fsys.Lookup(RootIno, "d07")
	if err != nil {
		b.Fatal(err)
	}
	list, err := fsys.ReadDirIno(d.Ino)
	if err != nil {
		b.Fatal(err)
	}
	buf := make([]byte, 4096)
	for b.Loop() {
		for _, e := range list {
			f, err := fsys.OpenIno(e.Ino)
			if err != nil {
				b.Fatal(err)
			}
			if _, err := f.ReadAt(buf, 0); err != nil && err != io.EOF {
				b.Fatal(err)
			}
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(len(list)), "ns/file")
}

// TestWalkMemory walks and reads the 50,000 files with a 4 MiB cache and
// checks that the memory in use stays within the cache and a few MiB,
// however many files have been seen: nothing grows with the tree.
func TestWalkMemory(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: makes a 50,000-file image")
	}
	img := makeWalkImage(t)
	f, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, _ := f.Stat()
	const cache = 4 << 20
	fsys, err := OpenOptions(f, st.Size(), Options{CacheBytes: cache})
	if err != nil {
		t.Fatal(err)
	}
	live := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	base := live()
	var most uint64
	files, _ := walkInodes(t, fsys, true, func(n int) {
		if n%5000 == 0 {
			most = max(most, live())
		}
	})
	if want := walkDirs*(walkFiles+1) + 1; files != want { // and lost+found
		t.Fatalf("%d files and folders, want %d", files, want)
	}
	grown := int64(most) - int64(base)
	t.Logf("live heap at most %.1f MiB above the start (cache %d MiB)", float64(grown)/(1<<20), cache>>20)
	if grown > cache+8<<20 {
		t.Errorf("the live heap grew by %d bytes walking %d files, more than the cache (%d) and 8 MiB", grown, files, cache)
	}
}

// BenchmarkLookup looks up every name of the 10,000-entry folder three
// ways: down its htree (e2fsck -fD indexed it), through the map of its
// names a linear folder gets (dirindex.go; warm), and entry by entry.
func BenchmarkLookup(b *testing.B) {
	c := imageCase{tree: fullTree, mkfs: []string{"-b", "4096"}}
	img := filepath.Join(b.TempDir(), "img")
	command(b, "cp", "--sparse=always", c.madeImage(b), img)
	if _, _, err := commandErr("e2fsck", "-fyD", img); err != nil && !isExit(err, 1) {
		b.Fatalf("e2fsck -fyD: %v", err)
	}
	fsys := openImage(b, img)
	root, _ := fsys.readInode(RootIno)
	dir, err := fsys.lookup(root, "bigdir")
	if err != nil || !fsys.isDx(dir) {
		b.Fatalf("bigdir: %v, hashed %v", err, err == nil && fsys.isDx(dir))
	}
	list, err := fsys.readDir(dir)
	if err != nil {
		b.Fatal(err)
	}
	for _, way := range []struct {
		name   string
		lookup func(name string) (uint32, bool, error)
	}{
		{"htree", func(name string) (uint32, bool, error) {
			ino, found, _, err := fsys.lookupDx(dir, name)
			return ino, found, err
		}},
		{"index", func(name string) (uint32, bool, error) {
			ino, found, _, err := fsys.lookupIndexed(dir, name)
			return ino, found, err
		}},
		{"linear", func(name string) (uint32, bool, error) { return fsys.lookupLinear(dir, name) }},
	} {
		b.Run(way.name, func(b *testing.B) {
			n := 0
			for b.Loop() {
				e := list[n%len(list)]
				n++
				if ino, found, err := way.lookup(e.Name); err != nil || !found || uint64(ino) != e.Ino {
					b.Fatalf("%q: %d, %v, %v", e.Name, ino, found, err)
				}
			}
		})
	}
}
