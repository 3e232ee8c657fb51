package qcow2

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// Backing and external data files.
//
// A backing file name is resolved like qemu's path_combine: an absolute
// name is used as is; a relative one is taken relative to the folder of the
// image that names it. Names qemu would hand to a protocol driver
// ("json:{...}", "nbd:...", "http://...") are refused outright: reading
// them could reach data far outside what the user asked for (the
// CVE-2024-4467 family). With Options.AllowedDirs set, the file actually
// opened (its path after symlinks, read back from /proc/self/fd) must lie
// inside one of those folders.

type fileID struct{ dev, ino uint64 }

// opener opens one backing chain, remembering every file it opened so that
// a chain that loops back on itself is refused.
type opener struct {
	opts    Options
	seen    map[fileID]string
	allowed []string // AllowedDirs after symlinks, cleaned
}

func (o *opener) openQcow2(path string, depth int) (*layer, error) {
	f, err := o.openFile(path)
	if err != nil {
		return nil, err
	}
	return o.openQcow2File(f, path, depth)
}

// openQcow2File reads the qcow2 image in f, opened as path, with its data
// file and backing chain. It owns f: on error, f is closed.
func (o *opener) openQcow2File(f *os.File, path string, depth int) (l *layer, err error) {
	l, err = newQcow2Layer(f, path, depth, &o.opts)
	if err != nil {
		f.Close()
		return nil, err
	}
	defer func() {
		if err != nil {
			for x := l; x != nil; x = x.backing {
				x.file.Close()
				if x.dataFile != nil {
					x.dataFile.Close()
				}
			}
		}
	}()
	h := l.hdr
	if h.IncompatibleFeatures&IncompatCorrupt != 0 && o.opts.Warnf != nil {
		o.opts.Warnf("%s: corrupt bit set: qemu found the image inconsistent; reading it anyway (read-only) as asked", path)
	}
	if h.IncompatibleFeatures&IncompatDirty != 0 && o.opts.Warnf != nil {
		o.opts.Warnf("%s: dirty bit set (not cleanly closed); refcounts may be stale, which does not matter for reading", path)
	}
	if h.IncompatibleFeatures&IncompatExternalData != 0 {
		name, err := o.resolve(path, "data file", h.DataFile)
		if err != nil {
			return nil, err
		}
		if l.dataFile, err = o.openFile(name); err != nil {
			return nil, fmt.Errorf("%s: data file: %w", path, err)
		}
		if l.dataFileSize, err = fileSize(l.dataFile); err != nil {
			return nil, err
		}
	}
	if h.BackingFile == "" || o.opts.NoBacking {
		return l, nil
	}
	if depth+1 > o.opts.MaxChainDepth {
		return nil, &RefusedError{File: path, Field: "backing file", Name: h.BackingFile,
			Reason: fmt.Sprintf("backing chain deeper than %d", o.opts.MaxChainDepth)}
	}
	name, err := o.resolve(path, "backing file", h.BackingFile)
	if err != nil {
		return nil, err
	}
	l.backing, err = o.openBacking(path, name, h.BackingFormat, depth+1)
	return l, err
}

// openBacking opens the backing file name of image parent in format fmt
// ("qcow2", "raw", or "" for probing).
func (o *opener) openBacking(parent, name, format string, depth int) (*layer, error) {
	f, err := o.openFile(name)
	if err != nil {
		return nil, fmt.Errorf("%s: backing file: %w", parent, err)
	}
	if format == "" {
		var b [4]byte
		if _, err := f.ReadAt(b[:], 0); err == nil && binary.BigEndian.Uint32(b[:]) == Magic {
			format = "qcow2"
		} else {
			format = "raw"
			if o.opts.Warnf != nil {
				o.opts.Warnf("%s: backing file %s has no format in the image; reading it as raw", parent, name)
			}
		}
	}
	switch format {
	case "qcow2":
		b, err := o.openQcow2File(f, name, depth)
		if err != nil {
			return nil, fmt.Errorf("%s: backing file: %w", parent, err)
		}
		return b, nil
	case "raw":
		size, err := fileSize(f)
		if err != nil {
			f.Close()
			return nil, err
		}
		return &layer{name: name, file: f, fileSize: size, size: size, depth: depth, raw: true}, nil
	default:
		f.Close()
		return nil, &UnsupportedError{File: parent, Feature: fmt.Sprintf("backing file format %q", format)}
	}
}

// openFile opens name read-only, refusing it if it was already opened in
// this chain or if it lies outside the allowed folders.
func (o *opener) openFile(name string) (*os.File, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, err
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		f.Close()
		return nil, err
	}
	if st.Mode&syscall.S_IFMT == syscall.S_IFDIR {
		f.Close()
		return nil, fmt.Errorf("%s: is a directory", name)
	}
	id := fileID{dev: st.Dev, ino: st.Ino}
	if prev, ok := o.seen[id]; ok {
		f.Close()
		return nil, &RefusedError{File: prev, Field: "backing file", Name: name, Reason: "the backing chain loops back to " + prev}
	}
	o.seen[id] = name
	if len(o.opts.AllowedDirs) > 0 {
		if err := o.confine(f, name); err != nil {
			f.Close()
			return nil, err
		}
	}
	return f, nil
}

// confine checks that the file f, opened as name, really lies inside an
// allowed folder. It asks the kernel where the open file is, so a symlink
// swapped in after the check cannot redirect the open.
func (o *opener) confine(f *os.File, name string) error {
	if o.allowed == nil {
		for _, d := range o.opts.AllowedDirs {
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
	return &RefusedError{File: name, Field: "file", Name: name, Reason: fmt.Sprintf("resolves to %s, outside the allowed folders", real)}
}

// resolve turns a backing or data file name stored in image into a path to
// open, refusing protocol names.
func (o *opener) resolve(image, field, name string) (string, error) {
	if strings.HasPrefix(name, "json:") {
		return "", &RefusedError{File: image, Field: field, Name: name, Reason: "json: pseudo-protocol names are not followed"}
	}
	// Like qemu's path_has_protocol: a colon before the first slash
	// names a protocol. "file:" is the plain file protocol.
	if i := strings.IndexByte(name, ':'); i >= 0 {
		if j := strings.IndexByte(name, '/'); j < 0 || i < j {
			if name[:i] != "file" {
				return "", &RefusedError{File: image, Field: field, Name: name, Reason: fmt.Sprintf("protocol %q is not followed; only local files are", name[:i])}
			}
			name = name[i+1:]
		}
	}
	if name == "" {
		return "", &RefusedError{File: image, Field: field, Name: name, Reason: "empty name"}
	}
	return FullBackingName(image, name), nil
}

// FullBackingName combines an image path and a backing file name the way
// qemu's path_combine does: an absolute name stands; a relative one is
// appended to the image's folder as written (not cleaned), so that
// "dir/top.qcow2" and "base.qcow2" give "dir/base.qcow2".
func FullBackingName(image, name string) string {
	if filepath.IsAbs(name) {
		return name
	}
	i := strings.LastIndexByte(image, '/')
	if i < 0 {
		return name
	}
	return image[:i+1] + name
}

func fileSize(f *os.File) (int64, error) {
	// Seek rather than stat, so that block devices report their size.
	size, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return 0, fmt.Errorf("%s: size: %w", f.Name(), err)
	}
	return size, nil
}

// readMagic returns the first four bytes of the file name as a big-endian
// number, or 0 if it is shorter.
func readMagic(name string) (uint32, error) {
	f, err := os.Open(name)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	var b [4]byte
	if _, err := io.ReadFull(f, b[:]); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return 0, nil
		}
		return 0, err
	}
	return binary.BigEndian.Uint32(b[:]), nil
}

// IsQcow2 reports whether the file at path starts with the qcow2 magic.
func IsQcow2(path string) (bool, error) {
	m, err := readMagic(path)
	return m == Magic, err
}
