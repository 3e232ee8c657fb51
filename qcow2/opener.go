package qcow2

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// The default opener: backing and data files on the local file system.
//
// A name is resolved like qemu's path_combine: an absolute name is used as
// is; a relative one is taken relative to the folder of the image that
// names it. Names qemu would hand to a protocol driver ("json:{...}",
// "nbd:...", "http://...") are refused outright: reading them could reach
// data far outside what the user asked for (the CVE-2024-4467 family).
// The file must be a regular file, checked on the opened descriptor, and
// is opened with O_NONBLOCK so that nothing (a fifo) can block the open.
// With AllowedDirs set, the file actually opened (its path after symlinks,
// read back from /proc/self/fd, so a symlink swapped in after a check
// cannot redirect it) must lie inside one of those folders.

// An Opener opens the files an image names: its backing file and its
// external data file.
type Opener interface {
	// Open opens the file that image names in field ("backing file" or
	// "data file") as name, exactly as the image stores it. Policy
	// refusals wrap ErrRefused.
	Open(image HostFile, field, name string) (HostFile, error)
}

// A WritableOpener can also open a data file for writing, for an image
// opened with Options.Writable.
type WritableOpener interface {
	OpenWritable(image HostFile, field, name string) (WritableFile, error)
}

// LocalOpener opens backing and data files on the local file system.
type LocalOpener struct {
	// AllowedDirs, when not empty, are the folders the opened files must
	// lie in, after symlinks.
	AllowedDirs []string

	allowed []string // AllowedDirs after symlinks, cleaned; made on first use
}

// Open resolves name against image's folder, opens it read-only and checks
// it.
func (o *LocalOpener) Open(image HostFile, field, name string) (HostFile, error) {
	return o.open(image, field, name, false)
}

// OpenWritable is Open, for reading and writing.
func (o *LocalOpener) OpenWritable(image HostFile, field, name string) (WritableFile, error) {
	f, err := o.open(image, field, name, true)
	if err != nil {
		return nil, err
	}
	return f.(*localFile), nil
}

func (o *LocalOpener) open(image HostFile, field, name string, writable bool) (HostFile, error) {
	path, err := resolveLocal(image.Name(), field, name)
	if err != nil {
		return nil, err
	}
	var f HostFile
	if writable {
		f, err = OpenWritableFile(path)
	} else {
		f, err = OpenFile(path)
	}
	if err != nil {
		return nil, err
	}
	lf := f.(*localFile)
	var st syscall.Stat_t
	if err := syscall.Fstat(int(lf.Fd()), &st); err != nil {
		f.Close()
		return nil, err
	}
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		f.Close()
		return nil, &RefusedError{File: image.Name(), Field: field, Name: name,
			Reason: fmt.Sprintf("%s is not a regular file (%s)", path, fileType(st.Mode))}
	}
	if len(o.AllowedDirs) > 0 {
		if err := o.confine(lf, image.Name(), field, name); err != nil {
			f.Close()
			return nil, err
		}
	}
	return f, nil
}

func fileType(mode uint32) string {
	switch mode & syscall.S_IFMT {
	case syscall.S_IFDIR:
		return "a directory"
	case syscall.S_IFBLK:
		return "a block device"
	case syscall.S_IFCHR:
		return "a character device"
	case syscall.S_IFIFO:
		return "a fifo"
	case syscall.S_IFSOCK:
		return "a socket"
	}
	return fmt.Sprintf("mode %#o", mode)
}

// confine checks that the file f really lies inside an allowed folder. It
// asks the kernel where the open file is.
func (o *LocalOpener) confine(f *localFile, image, field, name string) error {
	if o.allowed == nil {
		for _, d := range o.AllowedDirs {
			if real, err := filepath.EvalSymlinks(d); err == nil {
				o.allowed = append(o.allowed, filepath.Clean(real))
			}
		}
	}
	real, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(int(f.Fd())))
	if err != nil {
		return err
	}
	for _, d := range o.allowed {
		if real == d || strings.HasPrefix(real, d+"/") || d == "/" {
			return nil
		}
	}
	return &RefusedError{File: image, Field: field, Name: name, Reason: fmt.Sprintf("resolves to %s, outside the allowed folders", real)}
}

// resolveLocal turns a backing or data file name stored in image into a
// path to open, refusing protocol names.
func resolveLocal(image, field, name string) (string, error) {
	if strings.HasPrefix(name, "json:") {
		return "", &RefusedError{File: image, Field: field, Name: name, Reason: "json: pseudo-protocol names are not followed"}
	}
	// "file:" is the plain file protocol.
	if p, ok := protocol(name); ok {
		if p != "file" {
			return "", &RefusedError{File: image, Field: field, Name: name, Reason: fmt.Sprintf("protocol %q is not followed; only local files are", p)}
		}
		name = name[len(p)+1:]
	}
	if name == "" {
		return "", &RefusedError{File: image, Field: field, Name: name, Reason: "empty name"}
	}
	return FullBackingName(image, name), nil
}

// protocol returns the protocol a file name names, as qemu's
// path_has_protocol finds one: a colon before the first slash.
func protocol(name string) (string, bool) {
	i := strings.IndexByte(name, ':')
	if i < 0 {
		return "", false
	}
	if j := strings.IndexByte(name, '/'); j >= 0 && j < i {
		return "", false
	}
	return name[:i], true
}

// FullBackingName combines an image path and a backing file name the way
// qemu does (bdrv_get_full_backing_filename_from_filename): an absolute
// name, or one with a protocol (an http:// URL), stands; a relative one
// is appended to the image's folder as written (not cleaned), so that
// "dir/top.qcow2" and "base.qcow2" give "dir/base.qcow2".
func FullBackingName(image, name string) string {
	if _, ok := protocol(name); ok || filepath.IsAbs(name) {
		return name
	}
	i := strings.LastIndexByte(image, '/')
	if i < 0 {
		return name
	}
	return image[:i+1] + name
}
