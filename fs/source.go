package fs

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/qcow2"
)

// The source tree: every access to what the user mounted goes through a
// descriptor of its root folder, opened once at mount time, and resolves
// paths below it with openat2(RESOLVE_BENEATH): no component of a path may
// leave the tree, whatever was swapped in since it was listed (a folder
// replaced by a symlink to elsewhere while someone holds it open, say).
// Confinement is thereby checked at every access, by the kernel, not once
// at lookup time.
//
// Paths are relative to the root, slash separated, "" for the root itself.
// Symlinks are followed only where they resolve inside the tree: the
// listing resolves them once (their target's path relative to the root is
// what later accesses use), and openat2 refuses anything that escapes.

type source struct {
	root string // the root folder's absolute path, after symlinks: for messages
	fd   int    // O_PATH descriptor of the root folder
}

var _ tree = (*source)(nil)

func openSource(root string) (*source, error) {
	fd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: root, Err: err}
	}
	return &source{root: root, fd: fd}, nil
}

// abs is the absolute path of rel, for messages and for the library's
// relative backing file names.
func (s *source) abs(rel string) string {
	if rel == "" {
		return s.root
	}
	return s.root + "/" + rel
}

// backingName is rel's absolute path: an overlay names its original so,
// as qemu-img create -b does.
func (s *source) backingName(rel string) string { return s.abs(rel) }

func (s *source) names(rel, name string) bool { return name == s.abs(rel) }

// openat2 opens rel below the root. Symlinks inside the tree are followed;
// any resolution that would leave the tree fails (EXDEV), as do magic
// links (/proc/self/fd/N).
func (s *source) openat2(rel string, flags int) (int, error) {
	if rel == "" {
		rel = "."
	}
	flags |= unix.O_CLOEXEC
	if flags&unix.O_PATH == 0 {
		// (openat2 refuses O_PATH with anything but O_CLOEXEC,
		// O_DIRECTORY and O_NOFOLLOW.)
		flags |= unix.O_NOCTTY
	}
	how := unix.OpenHow{
		Flags:   uint64(flags),
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_MAGICLINKS,
	}
	for {
		fd, err := unix.Openat2(s.fd, rel, &how)
		if err == unix.EINTR || err == unix.EAGAIN {
			continue
		}
		if err != nil {
			return -1, &os.PathError{Op: "open", Path: s.abs(rel), Err: err}
		}
		return fd, nil
	}
}

// open opens the regular file rel for reading. It never blocks (O_NONBLOCK),
// and refuses anything but a regular file, checked on the descriptor.
func (s *source) open(rel string) (*os.File, error) {
	fd, err := s.openat2(rel, unix.O_RDONLY|unix.O_NONBLOCK)
	if err != nil {
		return nil, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, &os.PathError{Op: "stat", Path: s.abs(rel), Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		unix.Close(fd)
		return nil, &os.PathError{Op: "open", Path: s.abs(rel), Err: errors.New("not a regular file")}
	}
	return os.NewFile(uintptr(fd), s.abs(rel)), nil
}

// openRW opens the regular file rel for reading and writing, under the
// same rules as open.
func (s *source) openRW(rel string) (*os.File, error) {
	fd, err := s.openat2(rel, unix.O_RDWR|unix.O_NONBLOCK)
	if err != nil {
		return nil, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
		unix.Close(fd)
		return nil, &os.PathError{Op: "open", Path: s.abs(rel), Err: errors.New("not a regular file")}
	}
	return os.NewFile(uintptr(fd), s.abs(rel)), nil
}

// folder opens the folder rel.
func (s *source) folder(rel string) (folder, error) {
	fd, err := s.openat2(rel, unix.O_RDONLY|unix.O_DIRECTORY)
	if err != nil {
		return nil, err
	}
	return localFolder{os.NewFile(uintptr(fd), s.abs(rel))}, nil
}

// localFolder is a folder of a local tree, open.
type localFolder struct{ *os.File }

func (d localFolder) stat() (syscall.Stat_t, error) {
	var st syscall.Stat_t
	err := syscall.Fstat(int(d.Fd()), &st)
	return st, err
}

func (d localFolder) names() ([]string, error) { return d.Readdirnames(-1) }

func (d localFolder) lstat(name string) (syscall.Stat_t, error) { return lstatIn(d.File, name) }

// probe reads the regular file rel's first bytes (probeHead).
func (s *source) probe(rel string) (isQcow2, magic bool) {
	f, err := s.open(rel)
	if err != nil {
		return false, false
	}
	defer f.Close()
	return probeHead(f)
}

// probeHead reads a file's first bytes: whether qemu takes it for a qcow2
// image (qcow2.Probe), and whether it begins with qcow2's magic.
func probeHead(f io.ReaderAt) (isQcow2, magic bool) {
	var b [qcow2.ProbeSize]byte
	n, err := f.ReadAt(b[:], 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return false, false
	}
	return qcow2.Probe(b[:n]), n >= 4 && binary.BigEndian.Uint32(b[:4]) == qcow2.Magic
}

// openImage opens the image file rel, read-write if write.
func (s *source) openImage(rel string, write bool) (qcow2.HostFile, syscall.Stat_t, error) {
	var st syscall.Stat_t
	var f *os.File
	var err error
	if write {
		f, err = s.openRW(rel)
	} else {
		f, err = s.open(rel)
	}
	if err != nil {
		return nil, st, err
	}
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		f.Close()
		return nil, st, err
	}
	hf, err := qcow2.NewFile(f)
	return hf, st, err
}

// fileStat stats an open image file.
func (s *source) fileStat(f qcow2.HostFile) (syscall.Stat_t, error) {
	var st syscall.Stat_t
	fd, ok := f.(interface{ Fd() uintptr })
	if !ok {
		return st, errors.New("not a local file")
	}
	err := syscall.Fstat(int(fd.Fd()), &st)
	return st, err
}

// showsPlain: plain files are shown, spliced from their descriptor.
func (s *source) showsPlain() bool { return true }

// close closes the root's descriptor.
func (s *source) close() { unix.Close(s.fd) }

// openPlain opens the regular file rel for reading.
func (s *source) openPlain(rel string) (*os.File, error) { return s.open(rel) }

// statfs reports the source file system's numbers.
func (s *source) statfs(st *syscall.Statfs_t) error { return syscall.Fstatfs(s.fd, st) }

// configure confines backing files to the source folder, plus whatever
// folders the caller allows.
func (s *source) configure(o *qcow2.Options) {
	o.AllowedDirs = append([]string{s.root}, o.AllowedDirs...)
}

// stat stats rel, following symlinks inside the tree.
func (s *source) stat(rel string) (syscall.Stat_t, error) {
	var st syscall.Stat_t
	fd, err := s.openat2(rel, unix.O_PATH)
	if err != nil {
		return st, err
	}
	defer unix.Close(fd)
	if err := syscall.Fstat(fd, &st); err != nil {
		return st, &os.PathError{Op: "stat", Path: s.abs(rel), Err: err}
	}
	return st, nil
}

// lstatIn stats name in the folder d without following a symlink.
func lstatIn(d *os.File, name string) (syscall.Stat_t, error) {
	var st unix.Stat_t
	if err := unix.Fstatat(int(d.Fd()), name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return syscall.Stat_t{}, &os.PathError{Op: "lstat", Path: d.Name() + "/" + name, Err: err}
	}
	return syscall.Stat_t{
		Dev: st.Dev, Ino: st.Ino, Nlink: st.Nlink, Mode: st.Mode, Uid: st.Uid, Gid: st.Gid,
		Rdev: st.Rdev, Size: st.Size, Blksize: st.Blksize, Blocks: st.Blocks,
		Atim: syscall.Timespec(st.Atim), Mtim: syscall.Timespec(st.Mtim), Ctim: syscall.Timespec(st.Ctim),
	}, nil
}

// resolveLink returns where the symlink rel points, as a path relative to
// the root, or an error if it leads outside the tree (or nowhere).
func (s *source) resolveLink(rel string) (string, error) {
	target, err := filepath.EvalSymlinks(s.abs(rel))
	if err != nil {
		return "", err
	}
	if target == s.root {
		return "", nil
	}
	if !strings.HasPrefix(target, s.root+"/") && s.root != "/" {
		return "", fmt.Errorf("%s resolves to %s, outside the source folder", s.abs(rel), target)
	}
	r, err := filepath.Rel(s.root, target)
	if err != nil {
		return "", err
	}
	return r, nil
}

// join is rel/name.
func join(rel, name string) string {
	if rel == "" {
		return name
	}
	return rel + "/" + name
}
