package fat

import (
	"errors"
	"io"
	"io/fs"
	"slices"
	"strings"
	"time"

	"github.com/qcowfs/qcowfs/guestfs"
)

// The io/fs face of an FS: paths resolved by Lookup from the root, with
// Lookup's case rules ("README.TXT" opens "readme.txt").

// walk resolves name to its inode.
func (f *FS) walk(op, name string) (guestfs.Stat, string, error) {
	if !fs.ValidPath(name) {
		return guestfs.Stat{}, "", &fs.PathError{Op: op, Path: name, Err: fs.ErrInvalid}
	}
	st, err := f.rootStat()
	if err != nil {
		return st, "", &fs.PathError{Op: op, Path: name, Err: err}
	}
	base := "."
	if name == "." {
		return st, base, nil
	}
	for _, elem := range strings.Split(name, "/") {
		if st.Mode&sIFDIR == 0 {
			return st, "", &fs.PathError{Op: op, Path: name, Err: errNotDir}
		}
		if st, err = f.Lookup(st.Ino, elem); err != nil {
			return st, "", &fs.PathError{Op: op, Path: name, Err: unwrapNotExist(err)}
		}
		base = elem
	}
	if _, e, err := f.entry(st.Ino); err == nil {
		base = e.name() // the name as stored, whatever case was asked for
	}
	return st, base, nil
}

// unwrapNotExist makes a lookup miss plain fs.ErrNotExist for a
// PathError, keeping corruption errors as they are.
func unwrapNotExist(err error) error {
	if errors.Is(err, fs.ErrNotExist) {
		return fs.ErrNotExist
	}
	return err
}

// Open opens a regular file (a *File) or a directory (an fs.ReadDirFile).
func (f *FS) Open(name string) (fs.File, error) {
	st, base, err := f.walk("open", name)
	if err != nil {
		return nil, err
	}
	if st.Mode&sIFDIR != 0 {
		return &dirFile{fs: f, info: fileInfo{base, st}}, nil
	}
	file, err := f.openIno(st.Ino, base)
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: name, Err: err}
	}
	return file, nil
}

func (f *FS) Stat(name string) (fs.FileInfo, error) {
	st, base, err := f.walk("stat", name)
	if err != nil {
		return nil, err
	}
	return &fileInfo{base, st}, nil
}

// Lstat is Stat: FAT has no symbolic links.
func (f *FS) Lstat(name string) (fs.FileInfo, error) {
	st, base, err := f.walk("lstat", name)
	if err != nil {
		return nil, err
	}
	return &fileInfo{base, st}, nil
}

func (f *FS) ReadLink(name string) (string, error) {
	if _, _, err := f.walk("readlink", name); err != nil {
		return "", err
	}
	return "", &fs.PathError{Op: "readlink", Path: name, Err: fs.ErrInvalid}
}

// ReadDir lists directory name sorted by name, as fs.ReadDirFS asks.
func (f *FS) ReadDir(name string) ([]fs.DirEntry, error) {
	st, _, err := f.walk("readdir", name)
	if err != nil {
		return nil, err
	}
	es, err := f.readDir(st.Ino)
	if err != nil {
		return nil, &fs.PathError{Op: "readdir", Path: name, Err: err}
	}
	slices.SortFunc(es, func(a, b fs.DirEntry) int { return strings.Compare(a.Name(), b.Name()) })
	return es, nil
}

func (f *FS) readDir(ino uint64) ([]fs.DirEntry, error) {
	if ino != rootIno {
		if _, err := f.StatIno(ino); err != nil {
			return nil, err
		}
	}
	des, err := f.ReadDirIno(ino)
	if err != nil {
		return nil, err
	}
	out := make([]fs.DirEntry, len(des))
	for i, d := range des {
		out[i] = &dirEntry{f, d}
	}
	return out, nil
}

// fileInfo is an fs.FileInfo; Sys returns its guestfs.Stat.
type fileInfo struct {
	name string
	st   guestfs.Stat
}

func (i *fileInfo) Name() string       { return i.name }
func (i *fileInfo) Size() int64        { return i.st.Size }
func (i *fileInfo) ModTime() time.Time { return i.st.Mtime }
func (i *fileInfo) IsDir() bool        { return i.st.Mode&sIFDIR != 0 }
func (i *fileInfo) Sys() any           { return i.st }
func (i *fileInfo) Mode() fs.FileMode {
	m := fs.FileMode(i.st.Mode & 0o777)
	if i.IsDir() {
		m |= fs.ModeDir
	}
	return m
}

type dirEntry struct {
	fs *FS
	d  guestfs.DirEntry
}

func (e *dirEntry) Name() string { return e.d.Name }
func (e *dirEntry) IsDir() bool  { return e.d.Type == sIFDIR }
func (e *dirEntry) Type() fs.FileMode {
	if e.IsDir() {
		return fs.ModeDir
	}
	return 0
}
func (e *dirEntry) Info() (fs.FileInfo, error) {
	st, err := e.fs.StatIno(e.d.Ino)
	if err != nil {
		return nil, err
	}
	return &fileInfo{e.d.Name, st}, nil
}
func (e *dirEntry) String() string { return fs.FormatDirEntry(e) }

// dirFile is a directory opened through io/fs.
type dirFile struct {
	fs   *FS
	info fileInfo
	es   []fs.DirEntry // nil until the first ReadDir
	read bool
}

func (d *dirFile) Stat() (fs.FileInfo, error) { return &d.info, nil }
func (d *dirFile) Close() error               { return nil }
func (d *dirFile) Read([]byte) (int, error) {
	return 0, &fs.PathError{Op: "read", Path: d.info.name, Err: errIsDir}
}

// ReadDir returns the next n entries, in directory order (all of them
// for n <= 0), as fs.ReadDirFile does.
func (d *dirFile) ReadDir(n int) ([]fs.DirEntry, error) {
	if !d.read {
		es, err := d.fs.readDir(d.info.st.Ino)
		if err != nil {
			return nil, &fs.PathError{Op: "readdir", Path: d.info.name, Err: err}
		}
		d.es, d.read = es, true
	}
	if n <= 0 {
		es := d.es
		d.es = nil
		return es, nil
	}
	if len(d.es) == 0 {
		return nil, io.EOF
	}
	k := min(n, len(d.es))
	es := d.es[:k]
	d.es = d.es[k:]
	return es, nil
}
