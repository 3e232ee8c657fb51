package guesttest

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/guestfs"
)

// A Node is what a tree shows of one path: its stat, a symbolic link's
// target, a regular file's content (sha256) and data runs.
type Node struct {
	Mode                       uint32 // st_mode
	Uid, Gid                   uint32
	Size                       int64
	Ino                        uint64
	Nlink                      uint32
	Blocks                     int64
	Rdev                       uint64
	Atime, Mtime, Ctime, Btime time.Time
	Target                     string
	Sum                        string
	Data                       [][2]int64 // [start, end) of each data run, by SEEK_DATA/SEEK_HOLE
	// DataUnknown: lseek could not say. The kernel's SEEK_HOLE fails
	// with ENOENT on an ext4 inline-data file whose size runs past its
	// inline data (mkfs.ext4 -d makes such files of files of zeros).
	DataUnknown bool
}

// A Tree maps slash-separated paths relative to the root ("." for it) to
// their nodes.
type Tree map[string]*Node

// ReadOS reads the tree under root through the operating system (a
// source folder, a kernel mount), without following symbolic links.
// Paths in skip are left out with all below them.
func ReadOS(t testing.TB, root string, skip ...string) Tree {
	t.Helper()
	tree, err := ReadOSErr(root, skip...)
	if err != nil {
		t.Fatal(err)
	}
	return tree
}

// ReadOSErr is ReadOS, returning the first error.
func ReadOSErr(root string, skip ...string) (Tree, error) {
	tree := Tree{}
	var walk func(rel string) error
	walk = func(rel string) error {
		full := path.Join(root, rel)
		n, err := statOS(full)
		if err != nil {
			return fmt.Errorf("%s: %w", rel, err)
		}
		tree[rel] = n
		if n.Mode&unix.S_IFMT != unix.S_IFDIR {
			return nil
		}
		f, err := os.Open(full)
		if err != nil {
			return err
		}
		names, err := f.Readdirnames(-1)
		f.Close()
		if err != nil {
			return fmt.Errorf("%s: %w", rel, err)
		}
		for _, name := range names {
			child := path.Join(rel, name)
			if slices.Contains(skip, child) {
				continue
			}
			if err := walk(child); err != nil {
				return err
			}
		}
		return nil
	}
	return tree, walk(".")
}

func statOS(p string) (*Node, error) {
	var sx unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, p, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_BASIC_STATS|unix.STATX_BTIME, &sx); err != nil {
		return nil, fmt.Errorf("statx %s: %w", p, err)
	}
	ts := func(t unix.StatxTimestamp) time.Time { return time.Unix(t.Sec, int64(t.Nsec)) }
	n := &Node{
		Mode: uint32(sx.Mode), Uid: sx.Uid, Gid: sx.Gid, Size: int64(sx.Size), Ino: sx.Ino,
		Nlink: sx.Nlink, Blocks: int64(sx.Blocks), Rdev: unix.Mkdev(sx.Rdev_major, sx.Rdev_minor),
		Atime: ts(sx.Atime), Mtime: ts(sx.Mtime), Ctime: ts(sx.Ctime),
	}
	if sx.Mask&unix.STATX_BTIME != 0 {
		n.Btime = ts(sx.Btime)
	}
	switch n.Mode & unix.S_IFMT {
	case unix.S_IFLNK:
		target, err := os.Readlink(p)
		if err != nil {
			return nil, err
		}
		n.Target = target
	case unix.S_IFREG:
		f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW, 0)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		n.Data, err = dataRuns(n.Size, func(off int64, data bool) (int64, error) {
			whence := unix.SEEK_HOLE
			if data {
				whence = unix.SEEK_DATA
			}
			o, err := unix.Seek(int(f.Fd()), off, whence)
			if errors.Is(err, unix.ENXIO) {
				err = io.EOF
			}
			return o, err
		})
		if errors.Is(err, unix.ENOENT) {
			n.Data, n.DataUnknown, err = nil, true, nil
		}
		if err != nil {
			return nil, fmt.Errorf("%s: lseek: %w", p, err)
		}
		if n.Sum, err = contentSum(f, n.Size, n.Data, !n.DataUnknown); err != nil {
			return nil, fmt.Errorf("%s: %w", p, err)
		}
	}
	return n, nil
}

// contentSum is the sha256 of a file's content, as its 4 KiB blocks that
// are not all zeros, each after its offset: the same whatever the file's
// holes, but read only where its data runs say there is data (all of it
// if runs is not known), so that a sparse file of gigabytes costs what
// its data costs.
func contentSum(r io.ReaderAt, size int64, runs [][2]int64, known bool) (string, error) {
	const blk, chunk = 4096, 1 << 20
	if !known {
		runs = [][2]int64{{0, size}}
	}
	h := sha256.New()
	buf := make([]byte, chunk)
	var zero [blk]byte
	next := int64(0) // the first offset not hashed yet
	for _, run := range runs {
		start := max(run[0]&^(blk-1), next)
		end := min((run[1]+blk-1)&^(blk-1), size)
		for off := start; off < end; off += chunk {
			b := buf[:min(chunk, end-off)]
			if n, err := r.ReadAt(b, off); n < len(b) {
				return "", fmt.Errorf("reading %d bytes at %d: %d, %v", len(b), off, n, err)
			}
			for i := 0; i < len(b); i += blk {
				block := b[i:min(i+blk, len(b))]
				if string(block) == string(zero[:len(block)]) {
					continue
				}
				var o [8]byte
				binary.BigEndian.PutUint64(o[:], uint64(off+int64(i)))
				h.Write(o[:])
				h.Write(block)
			}
		}
		next = max(next, end)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// dataRuns lists a file's data runs with seek, which finds the next data
// (or hole) at or after an offset, io.EOF if none.
func dataRuns(size int64, seek func(off int64, data bool) (int64, error)) ([][2]int64, error) {
	var runs [][2]int64
	for off := int64(0); off < size; {
		d, err := seek(off, true)
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, err
		}
		h, err := seek(d, false)
		if err == io.EOF {
			h = size
		} else if err != nil {
			return nil, err
		}
		if h <= d {
			return nil, fmt.Errorf("data at %d, next hole at %d", d, h)
		}
		runs = append(runs, [2]int64{d, h})
		off = h
	}
	return runs, nil
}

// ReadFS reads fsys through its inode calls, from the root: ReadDirIno,
// StatIno, OpenIno, ReadLinkIno. It also checks, for every entry, that
// Lookup finds it with its inode and the entry's type is its inode's.
// Paths in skip are left out with all below them.
func ReadFS(t testing.TB, fsys guestfs.FS, skip ...string) Tree {
	t.Helper()
	tree := Tree{}
	var walk func(rel string, ino uint64)
	walk = func(rel string, ino uint64) {
		st, err := fsys.StatIno(ino)
		if err != nil {
			t.Fatalf("%s: StatIno(%d): %v", rel, ino, err)
		}
		n := &Node{Mode: st.Mode, Uid: st.Uid, Gid: st.Gid, Size: st.Size, Ino: st.Ino, Nlink: st.Nlink,
			Blocks: st.Blocks, Rdev: st.Rdev, Atime: st.Atime, Mtime: st.Mtime, Ctime: st.Ctime, Btime: st.Btime}
		tree[rel] = n
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFLNK:
			if n.Target, err = fsys.ReadLinkIno(ino); err != nil {
				t.Fatalf("%s: ReadLinkIno: %v", rel, err)
			}
		case unix.S_IFREG:
			if err := readFile(fsys, ino, n); err != nil {
				t.Fatalf("%s: %v", rel, err)
			}
		case unix.S_IFDIR:
			list, err := fsys.ReadDirIno(ino)
			if err != nil {
				t.Fatalf("%s: ReadDirIno: %v", rel, err)
			}
			for _, e := range list {
				child := path.Join(rel, e.Name)
				if slices.Contains(skip, child) {
					continue
				}
				got, err := fsys.Lookup(ino, e.Name)
				if err != nil || got.Ino != e.Ino {
					t.Errorf("%s: Lookup(%d, %q) = inode %d, %v; the directory lists inode %d", child, ino, e.Name, got.Ino, err, e.Ino)
				}
				if e.Type != 0 && e.Type != got.Mode&unix.S_IFMT {
					t.Errorf("%s: the directory says type 0%o, the inode 0%o", child, e.Type, got.Mode&unix.S_IFMT)
				}
				walk(child, e.Ino)
			}
		}
	}
	walk(".", fsys.RootIno())
	return tree
}

func readFile(fsys guestfs.FS, ino uint64, n *Node) error {
	f, err := fsys.OpenIno(ino)
	if err != nil {
		return fmt.Errorf("OpenIno: %w", err)
	}
	defer f.Close()
	n.Data, err = dataRuns(n.Size, func(off int64, data bool) (int64, error) {
		if data {
			return f.NextData(off)
		}
		return f.NextHole(off)
	})
	if err != nil {
		return err
	}
	// The whole file is read once: what the data runs skip must read as
	// zeros.
	if n.Sum, err = contentSum(f, n.Size, nil, false); err != nil {
		return err
	}
	sum, err := contentSum(f, n.Size, n.Data, true)
	if err == nil && sum != n.Sum {
		err = fmt.Errorf("data outside the data runs %v", n.Data)
	}
	return err
}

// Fields say what Compare compares.
type Fields uint32

const (
	Type     Fields = 1 << iota // S_IFMT
	Perm                        // the 07777 bits
	Owner                       // uid and gid
	Size                        // regular files and symbolic links
	DirSize                     // directories too
	Ino                         // inode numbers, exactly
	Links                       // which paths are one file (hard links), inode numbers aside
	Nlink                       // link counts
	Blocks                      // st_blocks
	Rdev                        // device numbers
	MtimeSec                    // mtime to the second
	Mtime                       // mtime to the nanosecond
	Times                       // atime, mtime, ctime and btime, to the nanosecond
	Target                      // symbolic link targets
	Content                     // regular files' bytes
	Holes                       // regular files' data runs

	// Source is what a file system made from a source tree keeps of it.
	Source = Type | Perm | Owner | Size | Links | Target | Content | Rdev
	// Kernel is all of it: what the kernel's mount of the same image shows.
	Kernel = Source | DirSize | Ino | Nlink | Blocks | Times | MtimeSec | Holes
)

// Compare reports, under label, every path that one tree has and the
// other lacks, and every field in f that differs.
func Compare(t testing.TB, label string, got, want Tree, f Fields) {
	t.Helper()
	if problems := Diff(got, want, f); len(problems) > 0 {
		if len(problems) > 40 {
			problems = append(problems[:40], fmt.Sprintf("... and %d more", len(problems)-40))
		}
		t.Errorf("%s: %d differences:\n%s", label, len(problems), strings.Join(problems, "\n"))
	}
}

// Diff lists every path that one tree has and the other lacks, and every
// field in f that differs.
func Diff(got, want Tree, f Fields) []string {
	var paths []string
	for p := range want {
		paths = append(paths, p)
	}
	for p := range got {
		if _, ok := want[p]; !ok {
			paths = append(paths, p)
		}
	}
	slices.Sort(paths)
	var problems []string
	report := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }
	inos := map[uint64]uint64{} // want's inode -> got's
	gotInos := map[uint64]uint64{}
	for _, p := range paths {
		g, w := got[p], want[p]
		switch {
		case g == nil:
			report("%q: missing", p)
			continue
		case w == nil:
			report("%q: extra", p)
			continue
		}
		diff := func(field string, gv, wv any) {
			if gv != wv {
				report("%q: %s %v, want %v", p, field, gv, wv)
			}
		}
		typ := w.Mode & unix.S_IFMT
		if f&Type != 0 {
			diff("type", g.Mode&unix.S_IFMT, typ)
		}
		if f&Perm != 0 {
			diff("mode", fmt.Sprintf("%04o", g.Mode&0o7777), fmt.Sprintf("%04o", w.Mode&0o7777))
		}
		if f&Owner != 0 {
			diff("owner", fmt.Sprintf("%d:%d", g.Uid, g.Gid), fmt.Sprintf("%d:%d", w.Uid, w.Gid))
		}
		if f&Size != 0 && (typ == unix.S_IFREG || typ == unix.S_IFLNK) || f&DirSize != 0 {
			diff("size", g.Size, w.Size)
		}
		if f&Ino != 0 {
			diff("inode", g.Ino, w.Ino)
		}
		if f&Links != 0 && typ != unix.S_IFDIR {
			if prev, ok := inos[w.Ino]; ok && prev != g.Ino {
				report("%q: inode %d, but another name of the same file has inode %d", p, g.Ino, prev)
			}
			if prev, ok := gotInos[g.Ino]; ok && prev != w.Ino {
				report("%q: inode %d, shared with a name of another file", p, g.Ino)
			}
			inos[w.Ino], gotInos[g.Ino] = g.Ino, w.Ino
		}
		if f&Nlink != 0 {
			diff("nlink", g.Nlink, w.Nlink)
		}
		if f&Blocks != 0 {
			diff("blocks", g.Blocks, w.Blocks)
		}
		if f&Rdev != 0 && (typ == unix.S_IFCHR || typ == unix.S_IFBLK) {
			diff("rdev", fmt.Sprintf("%d:%d", unix.Major(g.Rdev), unix.Minor(g.Rdev)), fmt.Sprintf("%d:%d", unix.Major(w.Rdev), unix.Minor(w.Rdev)))
		}
		if f&MtimeSec != 0 {
			diff("mtime (s)", g.Mtime.Unix(), w.Mtime.Unix())
		}
		if f&Mtime != 0 && !g.Mtime.Equal(w.Mtime) {
			report("%q: mtime %v, want %v", p, g.Mtime.UTC(), w.Mtime.UTC())
		}
		if f&Times != 0 {
			for _, tm := range []struct {
				name string
				g, w time.Time
			}{{"atime", g.Atime, w.Atime}, {"mtime", g.Mtime, w.Mtime}, {"ctime", g.Ctime, w.Ctime}, {"btime", g.Btime, w.Btime}} {
				if !tm.g.Equal(tm.w) {
					report("%q: %s %v, want %v", p, tm.name, tm.g.UTC(), tm.w.UTC())
				}
			}
		}
		if f&Target != 0 {
			diff("target", g.Target, w.Target)
		}
		if f&Content != 0 {
			diff("content sha256", g.Sum, w.Sum)
		}
		if f&Holes != 0 && typ == unix.S_IFREG && !g.DataUnknown && !w.DataUnknown {
			diff("data runs", fmt.Sprint(g.Data), fmt.Sprint(w.Data))
		}
	}
	return problems
}
