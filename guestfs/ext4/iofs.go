package ext4

import (
	"fmt"
	"io"
	iofs "io/fs"
	"path"
	"slices"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/guestfs"
)

// maxSymlinkHops bounds the symbolic links one path may go through, as
// the kernel's MAXSYMLINKS does.
const maxSymlinkHops = 40

// resolve walks name (an io/fs path) from the root. Symbolic links are
// followed as the kernel follows them in a chroot at the root: an
// absolute target starts again from the root, ".." stops there, so no
// link leads out of the file system; a final link is followed only if
// follow. ".." goes back along the walk, not through the ".." entry, and
// a directory entry that leads back to a directory of the walk is a loop:
// an error, not a path that never ends.
func (fs *FS) resolve(op, name string, follow bool) (*inode, error) {
	if !iofs.ValidPath(name) {
		return nil, &iofs.PathError{Op: op, Path: name, Err: iofs.ErrInvalid}
	}
	fail := func(err error) (*inode, error) { return nil, &iofs.PathError{Op: op, Path: name, Err: err} }
	root, err := fs.readInode(RootIno)
	if err != nil {
		return fail(err)
	}
	stack := []*inode{root}
	var comps []string
	if name != "." {
		comps = strings.Split(name, "/")
	}
	hops := 0
	for len(comps) > 0 {
		c := comps[0]
		comps = comps[1:]
		cur := stack[len(stack)-1]
		switch c {
		case "", ".":
			continue
		case "..":
			if len(stack) > 1 {
				stack = stack[:len(stack)-1]
			}
			continue
		}
		if !cur.isDir() {
			return fail(syscall.ENOTDIR)
		}
		child, err := fs.lookup(cur, c)
		if err != nil {
			return fail(err)
		}
		if child.fileType() == unix.S_IFLNK && (len(comps) > 0 || follow) {
			if hops++; hops > maxSymlinkHops {
				return fail(fmt.Errorf("more than %d symbolic links: %w", maxSymlinkHops, syscall.ELOOP))
			}
			target, err := fs.readLink(child)
			if err != nil {
				return fail(err)
			}
			if strings.HasPrefix(target, "/") {
				stack = stack[:1]
			}
			comps = append(strings.Split(target, "/"), comps...)
			continue
		}
		if child.isDir() {
			for _, a := range stack {
				if a.ino == child.ino {
					return fail(fs.formatError(cur.ino, "directory entry "+c, child.ino, "a directory that holds itself (a loop)"))
				}
			}
		}
		stack = append(stack, child)
	}
	return stack[len(stack)-1], nil
}

// Open opens name, following symbolic links: a directory as an
// iofs.ReadDirFile, a regular file as a guestfs.File.
func (fs *FS) Open(name string) (iofs.File, error) {
	in, err := fs.resolve("open", name, true)
	if err != nil {
		return nil, err
	}
	if in.isDir() {
		list, err := fs.readDir(in)
		if err != nil {
			return nil, &iofs.PathError{Op: "open", Path: name, Err: err}
		}
		return &dirFile{fs: fs, in: in, name: path.Base(name), list: fs.dirEntries(list)}, nil
	}
	f, err := fs.openInode(in, path.Base(name))
	if err != nil {
		return nil, &iofs.PathError{Op: "open", Path: name, Err: err}
	}
	return f, nil
}

// ReadDir lists directory name, sorted by name, following symbolic links.
func (fs *FS) ReadDir(name string) ([]iofs.DirEntry, error) {
	in, err := fs.resolve("readdir", name, true)
	if err != nil {
		return nil, err
	}
	list, err := fs.readDir(in)
	if err != nil {
		return nil, &iofs.PathError{Op: "readdir", Path: name, Err: err}
	}
	return fs.dirEntries(list), nil
}

// Stat describes name, following symbolic links.
func (fs *FS) Stat(name string) (iofs.FileInfo, error) {
	in, err := fs.resolve("stat", name, true)
	if err != nil {
		return nil, err
	}
	return &fileInfo{name: path.Base(name), st: fs.stat(in)}, nil
}

// Lstat describes name, a symbolic link itself rather than its target.
func (fs *FS) Lstat(name string) (iofs.FileInfo, error) {
	in, err := fs.resolve("lstat", name, false)
	if err != nil {
		return nil, err
	}
	return &fileInfo{name: path.Base(name), st: fs.stat(in)}, nil
}

// ReadLink returns the target of symbolic link name as stored.
func (fs *FS) ReadLink(name string) (string, error) {
	in, err := fs.resolve("readlink", name, false)
	if err != nil {
		return "", err
	}
	t, err := fs.readLink(in)
	if err != nil {
		return "", &iofs.PathError{Op: "readlink", Path: name, Err: err}
	}
	return t, nil
}

// dirEntries makes io/fs entries of a listing, sorted by name.
func (fs *FS) dirEntries(list []guestfs.DirEntry) []iofs.DirEntry {
	out := make([]iofs.DirEntry, len(list))
	for i, e := range list {
		out[i] = &dirEntry{fs: fs, e: e}
	}
	slices.SortFunc(out, func(a, b iofs.DirEntry) int { return strings.Compare(a.Name(), b.Name()) })
	return out
}

// FileMode converts st_mode to an io/fs mode.
func FileMode(mode uint32) iofs.FileMode {
	m := iofs.FileMode(mode & 0o777)
	switch mode & unix.S_IFMT {
	case unix.S_IFDIR:
		m |= iofs.ModeDir
	case unix.S_IFLNK:
		m |= iofs.ModeSymlink
	case unix.S_IFCHR:
		m |= iofs.ModeDevice | iofs.ModeCharDevice
	case unix.S_IFBLK:
		m |= iofs.ModeDevice
	case unix.S_IFIFO:
		m |= iofs.ModeNamedPipe
	case unix.S_IFSOCK:
		m |= iofs.ModeSocket
	}
	if mode&unix.S_ISUID != 0 {
		m |= iofs.ModeSetuid
	}
	if mode&unix.S_ISGID != 0 {
		m |= iofs.ModeSetgid
	}
	if mode&unix.S_ISVTX != 0 {
		m |= iofs.ModeSticky
	}
	return m
}

// fileInfo is an inode's iofs.FileInfo; Sys returns its guestfs.Stat.
type fileInfo struct {
	name string
	st   guestfs.Stat
}

func (i *fileInfo) Name() string        { return i.name }
func (i *fileInfo) Size() int64         { return i.st.Size }
func (i *fileInfo) Mode() iofs.FileMode { return FileMode(i.st.Mode) }
func (i *fileInfo) ModTime() time.Time  { return i.st.Mtime }
func (i *fileInfo) IsDir() bool         { return i.st.Mode&unix.S_IFMT == unix.S_IFDIR }
func (i *fileInfo) Sys() any            { return i.st }
func (i *fileInfo) String() string      { return iofs.FormatFileInfo(i) }

// dirEntry is one entry of a listing; its Info reads the inode.
type dirEntry struct {
	fs *FS
	e  guestfs.DirEntry
}

func (e *dirEntry) String() string      { return iofs.FormatDirEntry(e) }
func (e *dirEntry) Name() string        { return e.e.Name }
func (e *dirEntry) IsDir() bool         { return e.Type().IsDir() }
func (e *dirEntry) Type() iofs.FileMode { return e.typ().Type() }

// typ is the entry's type from the directory, or without the filetype
// feature, from its inode.
func (e *dirEntry) typ() iofs.FileMode {
	if e.e.Type != 0 {
		return FileMode(e.e.Type)
	}
	if in, err := e.fs.readInode(e.e.Ino); err == nil {
		return FileMode(uint32(in.mode))
	}
	return iofs.ModeIrregular
}

func (e *dirEntry) Info() (iofs.FileInfo, error) {
	in, err := e.fs.readInode(e.e.Ino)
	if err != nil {
		return nil, err
	}
	return &fileInfo{name: e.e.Name, st: e.fs.stat(in)}, nil
}

// dirFile is an open directory: its listing, read when it was opened.
type dirFile struct {
	fs   *FS
	in   *inode
	name string
	list []iofs.DirEntry
	pos  int
}

func (d *dirFile) Stat() (iofs.FileInfo, error) {
	return &fileInfo{name: d.name, st: d.fs.stat(d.in)}, nil
}

func (d *dirFile) Read([]byte) (int, error) {
	return 0, &iofs.PathError{Op: "read", Path: d.name, Err: syscall.EISDIR}
}

func (d *dirFile) Close() error { return nil }

func (d *dirFile) ReadDir(n int) ([]iofs.DirEntry, error) {
	rest := d.list[d.pos:]
	if n <= 0 {
		d.pos = len(d.list)
		return rest, nil
	}
	if len(rest) == 0 {
		return nil, io.EOF
	}
	rest = rest[:min(n, len(rest))]
	d.pos += len(rest)
	return rest, nil
}
