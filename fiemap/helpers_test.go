package fiemap

import (
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// Test helpers: the file systems tests run on, file layouts, and the
// oracle, which is the kernel's own lseek(SEEK_DATA/SEEK_HOLE).

// fsNames names the file systems these tests meet, by statfs f_type.
var fsNames = map[int64]string{
	unix.EXT4_SUPER_MAGIC:  "ext4",
	unix.TMPFS_MAGIC:       "tmpfs",
	unix.XFS_SUPER_MAGIC:   "xfs",
	unix.BTRFS_SUPER_MAGIC: "btrfs",
}

// fsType returns the name of the file system holding dir.
func fsType(t testing.TB, dir string) (int64, string) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatalf("statfs %s: %v", dir, err)
	}
	name, ok := fsNames[int64(st.Type)]
	if !ok {
		name = fmt.Sprintf("fs%#x", st.Type)
	}
	return int64(st.Type), name
}

// wantMethod is the method a Map must settle on for a non-empty file on a
// file system of type typ, or MethodUnknown when the test does not know.
func wantMethod(typ int64) Method {
	switch typ {
	case unix.EXT4_SUPER_MAGIC, unix.XFS_SUPER_MAGIC, unix.BTRFS_SUPER_MAGIC:
		return MethodFiemap
	case unix.TMPFS_MAGIC:
		return MethodLseek // tmpfs has no fiemap inode operation: EOPNOTSUPP
	}
	return MethodUnknown
}

// tmpfsDir mounts a fresh tmpfs for the test and unmounts it when the test
// ends. Without root the test is skipped; as root, a failed mount skips it
// too unless CI=true, where it fails.
func tmpfsDir(t testing.TB) string {
	if os.Geteuid() != 0 {
		t.Skip("not root: cannot mount a tmpfs")
	}
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=256m,mode=0700"); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("mount tmpfs on %s: %v", dir, err)
		}
		t.Skipf("mount tmpfs on %s: %v", dir, err)
	}
	// Registered after t.TempDir's removal, so it runs before it.
	t.Cleanup(func() {
		if err := unix.Unmount(dir, 0); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
			unix.Unmount(dir, unix.MNT_DETACH)
		}
	})
	return dir
}

// forEachFS runs f on the default temporary folder's file system and on
// a tmpfs, as subtests named after the file system.
func forEachFS(t *testing.T, f func(t *testing.T, dir string, typ int64)) {
	dir := t.TempDir()
	typ, name := fsType(t, dir)
	t.Run(name, func(t *testing.T) { f(t, dir, typ) })
	t.Run("tmpfs mount", func(t *testing.T) {
		dir := tmpfsDir(t)
		typ, _ := fsType(t, dir)
		f(t, dir, typ)
	})
}

// A step is one operation that shapes a test file.
type step func(t testing.TB, f *os.File)

// write writes n non-zero bytes at off.
func write(off, n int64) step {
	return func(t testing.TB, f *os.File) {
		t.Helper()
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(i%251) + 1
		}
		if _, err := f.WriteAt(b, off); err != nil {
			t.Fatalf("pwrite %d bytes at %d: %v", n, off, err)
		}
	}
}

func truncate(size int64) step {
	return func(t testing.TB, f *os.File) {
		t.Helper()
		if err := f.Truncate(size); err != nil {
			t.Fatalf("ftruncate to %d: %v", size, err)
		}
	}
}

// fallocate with mode 0 makes unwritten extents (and extends the file);
// with FALLOC_FL_KEEP_SIZE it allocates past the end without extending.
func fallocate(mode uint32, off, n int64) step {
	return func(t testing.TB, f *os.File) {
		t.Helper()
		if err := unix.Fallocate(int(f.Fd()), mode, off, n); err != nil {
			t.Fatalf("fallocate(%#x, %d, %d): %v", mode, off, n, err)
		}
	}
}

func punch(off, n int64) step {
	return fallocate(unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n)
}

// fsync writes dirty pages back: delayed allocations become extents, and
// written parts of unwritten extents become written extents.
func fsync(t testing.TB, f *os.File) {
	t.Helper()
	if err := f.Sync(); err != nil {
		t.Fatalf("fsync: %v", err)
	}
}

// fragment writes n blocks of data, one every stride bytes from 0.
func fragment(n int, block, stride int64) step {
	return func(t testing.TB, f *os.File) {
		for i := range int64(n) {
			write(i*stride, block)(t, f)
		}
	}
}

func steps(s ...step) step {
	return func(t testing.TB, f *os.File) {
		for _, s := range s {
			s(t, f)
		}
	}
}

// A layout is a test file's shape.
type layout struct {
	name  string
	build step
}

// layouts are the files every method is compared with the kernel on.
var layouts = []layout{
	{"empty", steps()},
	{"hole only", truncate(8 << 20)},
	{"fully written", write(0, 1<<20+123)},
	{"scattered writes", steps(write(0, 4096), write(100_000, 5000), write(1<<20, 64<<10),
		write(3<<20+17, 1), truncate(6<<20))},
	{"data at end", steps(truncate(4<<20-100), write(4<<20-100, 100))},
	{"unaligned", steps(write(10, 10), truncate(1<<20+1), write(1<<20-5, 6))},
	{"fallocated", fallocate(0, 0, 4<<20)},
	{"fallocated, written", steps(fallocate(0, 0, 4<<20), write(1<<20+100, 10_000), write(3<<20, 4096))},
	{"fallocated, written, synced", steps(fallocate(0, 0, 4<<20), write(1<<20+100, 10_000),
		write(3<<20, 4096), fsync)},
	{"fallocated in a hole", steps(truncate(8<<20), fallocate(0, 2<<20, 1<<20), write(6<<20, 4096))},
	{"fallocated past EOF", steps(write(0, 64<<10), fallocate(unix.FALLOC_FL_KEEP_SIZE, 64<<10, 1<<20))},
	{"punched", steps(write(0, 2<<20), punch(4096, 8192), punch(100_000, 50_000), punch(1<<20, 1<<20))},
	{"punched, synced", steps(write(0, 2<<20), fsync, punch(4096, 8192), punch(100_000, 50_000),
		punch(1<<20, 1<<20))},
	{"fragmented", fragment(600, 4096, 8192)},
	{"fragmented, synced", steps(fragment(600, 4096, 8192), fsync)},
	{"fragmented, dirty over unwritten", steps(fallocate(0, 0, 4<<20), fragment(300, 4096, 12288))},
	{"fragmented unwritten", steps(fallocate(0, 0, 4<<20), fsync, fragment(300, 4096, 12288), fsync)},
	{"huge sparse", steps(write(0, 4096), write(1<<39+12345, 8192), truncate(1<<40), write(1<<40-4096, 4096))},
}

// makeFile creates a file in dir shaped by build and returns it open for
// reading and writing; it is closed when the test ends.
func makeFile(t testing.TB, dir, name string, build step) *os.File {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(dir, name), os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	build(t, f)
	return f
}

// newMap maps f with opt; method, unless MethodUnknown, forces how the
// host is asked (the test hook for the fallbacks).
func newMap(t testing.TB, f *os.File, opt *Options, method Method) *Map {
	t.Helper()
	m, err := New(f, opt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	m.method.Store(int32(method))
	return m
}

// kernel is the oracle: lseek on a descriptor of its own.
type kernel struct {
	fd   int
	size int64
}

func newKernel(t testing.TB, f *os.File) *kernel {
	t.Helper()
	g, err := os.Open(f.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.Close() })
	fi, err := g.Stat()
	if err != nil {
		t.Fatal(err)
	}
	return &kernel{fd: int(g.Fd()), size: fi.Size()}
}

// next is lseek(whence, off), with ENXIO as io.EOF like a Map.
func (k *kernel) next(t testing.TB, off int64, whence int) (int64, error) {
	t.Helper()
	r, err := unix.Seek(k.fd, off, whence)
	if errors.Is(err, syscall.ENXIO) {
		return 0, io.EOF
	}
	if err != nil {
		t.Fatalf("lseek(%d, %d): %v", off, whence, err)
	}
	return r, nil
}

// walk lists the data extents as lseek sees them.
func (k *kernel) walk(t testing.TB) []run {
	var runs []run
	for off := int64(0); ; {
		d, err := k.next(t, off, unix.SEEK_DATA)
		if err == io.EOF {
			return runs
		}
		h, err := k.next(t, d, unix.SEEK_HOLE)
		if err != nil {
			t.Fatalf("lseek(SEEK_HOLE, %d) after data: %v", d, err)
		}
		runs = append(runs, run{d, h})
		off = h
	}
}

// walk lists the data extents as m sees them, alternating NextData and
// NextHole from 0 to the end of the file.
func walk(t testing.TB, m *Map) []run {
	t.Helper()
	var runs []run
	for off := int64(0); ; {
		d, err := m.NextData(off)
		if err == io.EOF {
			return runs
		}
		if err != nil {
			t.Fatalf("NextData(%d): %v", off, err)
		}
		h, err := m.NextHole(d)
		if err != nil {
			t.Fatalf("NextHole(%d) after data: %v", d, err)
		}
		if h <= d {
			t.Fatalf("NextHole(%d) = %d, not after the data", d, h)
		}
		runs = append(runs, run{d, h})
		off = h
	}
}

// probes are offsets worth asking about for a file of size with data
// runs: every boundary and its neighbours, the end of the file, and n
// pseudo-random offsets, shuffled.
func probes(size int64, runs []run, n int, seed uint64) []int64 {
	offs := []int64{0, 1, size - 1, size, size + 1, size + 4096, 1 << 62}
	for _, r := range runs {
		offs = append(offs, r.start-1, r.start, r.start+1, r.end-1, r.end, r.end+1)
	}
	rng := rand.New(rand.NewPCG(seed, 0))
	for range n {
		offs = append(offs, rng.Int64N(size+1))
	}
	var out []int64
	for _, o := range offs {
		if o >= 0 {
			out = append(out, o)
		}
	}
	rng.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	return out
}
