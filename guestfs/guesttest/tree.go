// Package guesttest makes the guest file trees of issue 46's tests and
// reads trees back for comparison: a source folder or a kernel mount
// through the operating system (ReadOS), a guestfs.FS through its inode
// calls (ReadFS). The tests of guestfs/ext4 and guestfs/fat, and the
// end-to-end tests of the FUSE view, compare what a reader shows with the
// source tree and with the kernel's own mount of the same image.
package guesttest

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Options say what Write puts in a tree.
type Options struct {
	// MaxSymlink is the longest symbolic link target the file system
	// takes (ext4: its block size less one, at most 4095).
	MaxSymlink int
	// Owners: files owned by users and groups other than root, some
	// with ids past 16 bits (needs root).
	Owners bool
	// Special: device nodes, a FIFO and a socket (needs root for the
	// devices).
	Special bool
	// Big adds a 300 MiB file, sparse but for a few MiB of data at its
	// start, middle and end, and a sparse file past 4 GiB.
	Big bool
	// BigDir is the number of entries of the big directory (10,000 in
	// the trees; 0 leaves it out).
	BigDir int
	// Times: files with nanosecond times, times before 1970 and after
	// 2038.
	Times bool
}

// Dangling lists the paths of a tree whose symbolic links lead nowhere
// (dangling, or a loop); Open cannot follow them.
var Dangling = []string{"links/dangling", "links/loop1", "links/loop2", "links/self", "owners/link-4242"}

// BigFile and HugeFile are the paths of the 300 MiB file and of a
// sparse file of a little more than 4 GiB (Options.Big).
const (
	BigFile  = "sparse/big-300M"
	HugeFile = "sparse/huge-4G"
)

// UnwrittenFile is the path of a file allocated with fallocate and then
// written in part: on ext4, unwritten extents around a written one.
const UnwrittenFile = "sparse/unwritten"

// WriteUnwritten makes file name as UnwrittenFile is made: 1 MiB
// allocated, 4 KiB of 'u' written at 256 KiB (1 MiB of holes instead,
// where the file system cannot allocate without writing).
func WriteUnwritten(t testing.TB, name string) {
	t.Helper()
	f, err := os.Create(name)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	// Without extents (ext2, ext3) there is nothing to allocate unwritten:
	// the same bytes, with holes.
	err = unix.Fallocate(int(f.Fd()), 0, 0, 1<<20)
	if errors.Is(err, unix.EOPNOTSUPP) {
		err = f.Truncate(1 << 20)
	}
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte(strings.Repeat("u", 4096)), 256<<10); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
}

// Write fills dir with the tree: files of many sizes, sparse files,
// symbolic links of every kind, hard links, a big directory, Unicode and
// odd names, 40-deep nesting, every mode bit; with o, owners, device
// nodes, a FIFO, a socket, a 300 MiB file, odd times. Contents are
// pseudo-random from a fixed seed.
func Write(t testing.TB, dir string, o Options) {
	t.Helper()
	rng := rand.New(rand.NewChaCha8([32]byte{'g', 'u', 'e', 's', 't'}))
	random := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		return b
	}
	check := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	p := func(rel string) string { return filepath.Join(dir, rel) }
	mkdir := func(rel string) { check(os.MkdirAll(p(rel), 0o755)) }
	file := func(rel string, b []byte) { check(os.WriteFile(p(rel), b, 0o644)) }
	// sparse writes data runs into a file of size bytes.
	sparse := func(rel string, size int64, runs map[int64]int) {
		f, err := os.Create(p(rel))
		check(err)
		defer f.Close()
		check(f.Truncate(size))
		for off, n := range runs {
			_, err := f.WriteAt(random(n), off)
			check(err)
		}
	}

	mkdir("files")
	for _, n := range []int{0, 1, 59, 60, 61, 100, 4095, 4096, 4097, 65537, 3<<20 + 7} {
		file(fmt.Sprintf("files/size-%d", n), random(n))
	}
	file("files/zeros-8192", make([]byte, 8192))

	mkdir("sparse")
	sparse("sparse/holes", 8<<20, map[int64]int{0: 4096, 2 << 20: 1 << 20, 8<<20 - 1: 1})
	sparse("sparse/hole-first", 4<<20, map[int64]int{3 << 20: 5000})
	sparse("sparse/all-hole", 1<<20, nil)
	sparse("sparse/unaligned", 1<<20+123, map[int64]int{70000: 10, 1 << 20: 123})
	WriteUnwritten(t, p(UnwrittenFile))
	if o.Big {
		sparse(BigFile, 300<<20, map[int64]int{0: 1 << 20, 150 << 20: 1 << 20, 300<<20 - 4096: 4096})
		// Past 4 GiB: i_size's high word, blocks past 2^32 bytes; data
		// across the 4 GiB line.
		sparse(HugeFile, 4<<30+4097, map[int64]int{4<<30 - 2048: 4096, 4<<30 + 4096: 1})
	}

	mkdir("links")
	link := func(target, rel string) { check(os.Symlink(target, p(rel))) }
	link("../files/size-1", "links/relative")
	link("/files/size-4096", "links/absolute")
	link("no/such/file", "links/dangling")
	link("loop2", "links/loop1")
	link("loop1", "links/loop2")
	link("self", "links/self")
	link("../files", "links/to-dir")
	link(padTarget("../files/size-100", 100), "links/slow-100")
	maxLink := o.MaxSymlink
	if maxLink == 0 || maxLink > 4095 {
		maxLink = 4095
	}
	link(padTarget("../files/size-4096", maxLink), "links/longest")
	link(padTarget("../files/size-1", 59), "links/fast-59")
	link(padTarget("../files/size-1", 60), "links/slow-60")

	mkdir("hard/sub")
	file("hard/a", random(5000))
	check(os.Link(p("hard/a"), p("hard/b")))
	check(os.Link(p("hard/a"), p("hard/sub/c")))

	if o.BigDir > 0 {
		mkdir("bigdir")
		for i := range o.BigDir {
			// Names of many lengths, so the entries fill blocks
			// unevenly; short on the whole, for mkfs.ext4 -d reads the
			// whole folder again for each entry it adds.
			name := fmt.Sprintf("%d%s", i, strings.Repeat("x", i%17))
			check(os.WriteFile(p("bigdir/"+name), nil, 0o644))
		}
		mkdir("bigdir/a-subdir")
	}

	mkdir("names")
	for _, n := range OddNames {
		file("names/"+n, []byte(n))
	}

	deep := "deep"
	for i := 1; i <= 40; i++ {
		deep += fmt.Sprintf("/d%02d", i)
	}
	mkdir(deep)
	file(deep+"/leaf", []byte("40 folders down\n"))

	mkdir("modes")
	for _, m := range []os.FileMode{0, 0o1, 0o2, 0o4, 0o10, 0o20, 0o40, 0o100, 0o200, 0o400, 0o644, 0o755, 0o777} {
		name := fmt.Sprintf("modes/file-%04o", m)
		file(name, []byte(name))
		check(os.Chmod(p(name), m))
	}
	// Chmod through the file system: os.Chmod takes Go's mode bits.
	for _, m := range []uint32{0o1644, 0o2755, 0o4755, 0o7777, 0o6711} {
		name := fmt.Sprintf("modes/file-%04o", m)
		file(name, []byte(name))
		check(unix.Chmod(p(name), m))
	}
	for _, m := range []uint32{0o1777, 0o2775, 0o700, 0o000, 0o3777} {
		name := fmt.Sprintf("modes/dir-%04o", m)
		mkdir(name)
		check(unix.Chmod(p(name), m))
	}

	if o.Owners {
		mkdir("owners")
		for _, id := range [][2]int{{1000, 1000}, {65534, 65534}, {65536, 70000}, {123456789, 987654321}, {0, 4294967294}} {
			name := fmt.Sprintf("owners/%d-%d", id[0], id[1])
			file(name, []byte(name))
			check(os.Lchown(p(name), id[0], id[1]))
		}
		link("target", "owners/link-4242")
		check(os.Lchown(p("owners/link-4242"), 4242, 4343))
		mkdir("owners/dir-77777")
		check(os.Lchown(p("owners/dir-77777"), 77777, 77777))
	}

	if o.Special {
		mkdir("special")
		check(unix.Mknod(p("special/null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
		check(unix.Mknod(p("special/sda1"), unix.S_IFBLK|0o660, int(unix.Mkdev(8, 1))))
		// Past 8 bits of major and minor: the new encoding.
		check(unix.Mknod(p("special/big-dev"), unix.S_IFCHR|0o600, int(unix.Mkdev(300, 70000))))
		check(unix.Mkfifo(p("special/fifo"), 0o640))
		l, err := net.ListenUnix("unix", &net.UnixAddr{Name: p("special/socket"), Net: "unix"})
		check(err)
		l.SetUnlinkOnClose(false)
		l.Close()
	}

	if o.Times {
		mkdir("times")
		for name, ts := range map[string]time.Time{
			"nanoseconds": time.Unix(1700000000, 123456789),
			"before-1970": time.Unix(-86400*365*10-1, 500000000),
			"after-2038":  time.Unix(1<<31+12345, 999999999),
			"year-2400":   time.Unix(13569465600, 1),
		} {
			file("times/"+name, []byte(name))
			// atime an hour before mtime.
			ns := []unix.Timespec{{Sec: ts.Unix() - 3600, Nsec: int64(ts.Nanosecond())}, {Sec: ts.Unix(), Nsec: int64(ts.Nanosecond())}}
			check(unix.UtimesNanoAt(unix.AT_FDCWD, p("times/"+name), ns, unix.AT_SYMLINK_NOFOLLOW))
		}
	}
}

// OddNames are the names of names/: Unicode, spaces, control and shell
// characters, a backslash, the longest name, bytes that are not UTF-8.
var OddNames = []string{
	"héllo wörld", "日本語のファイル名", "emoji-😀🎉", "with space", " leading space", "trailing space ",
	"new\nline", "tab\there", "back\\slash", "star*question?[bracket]", "-dash", ".hidden", "..two-dots", "...",
	"quotes\"'`", "percent%s", strings.Repeat("n", 255), strings.Repeat("é", 127) + "x", "bad-utf8-\xff\xfe",
}

// padTarget lengthens target to n bytes with "./" steps (and one doubled
// slash) that lead to the same file.
func padTarget(target string, n int) string {
	pad := n - len(target)
	if pad <= 0 {
		return target
	}
	if pad%2 == 1 {
		target = strings.Replace(target, "/", "//", 1)
		pad--
	}
	return strings.Repeat("./", pad/2) + target
}
