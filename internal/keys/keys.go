// Package keys gives each encrypted image file of a mount (or of one
// qcowfs info, map or check) its passphrase, from the command line's
// --key-file and --key-dir, and keeps those passphrases out of everything
// but the unlocking: one buffer for the --key-file's bytes, cleared by
// Close; a --key-dir file read when an image asks for it, into a buffer
// the caller (qcow2, which clears it once the key is unlocked) owns.
//
// A key file's bytes are the passphrase as they are, the way qemu takes a
// secret object's file= (crypto/secret.c, g_file_get_contents): a
// trailing newline is part of the passphrase. qemu refuses a secret that
// is not valid UTF-8 (crypto/secret_common.c, g_utf8_validate, which also
// refuses a NUL byte); so does this package, with the reason, rather than
// try a passphrase qemu would never have made.
//
// Which file's passphrase: a file named by its path relative to one of
// the Ring's roots (the source folder, the overlay folder) has the key
// DIR/PATH in --key-dir if that file exists; every other file, and a file
// without one in --key-dir, has the --key-file's; with neither, none.
package keys

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"unicode/utf8"
)

// MaxBytes bounds a key file: a passphrase, not a data file.
const MaxBytes = 64 << 10

// A Ring holds a mount's keys: the --key-file's bytes and where the
// --key-dir files are. Its methods are safe for concurrent use.
type Ring struct {
	file     []byte // the --key-file's bytes; nil without one
	fileName string
	dir      string   // the --key-dir, absolute; "" without one
	roots    []string // folders (absolute, clean) or URL prefixes (ending in "/")
	warnf    func(format string, args ...any)

	mu     sync.Mutex
	closed bool
	warned map[string]bool // key files warned of (permissions, content)
}

// New makes a ring of the key file fileName (its bytes read already, by
// ReadFile or from the mount's parent) and the key folder dir; either
// may be empty. warnf, if set, receives a line for each --key-dir file
// that is readable by group or others, or that cannot be used, the first
// time it is read. The ring owns file: Close clears it.
func New(file []byte, fileName, dir string, warnf func(format string, args ...any)) (*Ring, error) {
	r := &Ring{file: file, fileName: fileName, warnf: warnf, warned: map[string]bool{}}
	if fileName != "" && file == nil {
		r.file = []byte{}
	}
	if dir != "" {
		abs, err := filepath.Abs(dir)
		if err != nil {
			return nil, err
		}
		st, err := os.Stat(abs)
		if err != nil {
			return nil, fmt.Errorf("--key-dir: %w", err)
		}
		if !st.IsDir() {
			return nil, fmt.Errorf("--key-dir %s: not a folder", dir)
		}
		r.dir = abs
	}
	return r, nil
}

// OnWarning sets where the ring's warnings go (see New); call it before
// the ring is used.
func (r *Ring) OnWarning(warnf func(format string, args ...any)) { r.warnf = warnf }

// WriteFileKey writes the --key-file's bytes to w (the pipe to a mount's
// daemon), and nothing if there is no --key-file.
func (r *Ring) WriteFileKey(w io.Writer) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.fileName == "" || r.closed {
		return nil
	}
	_, err := w.Write(r.file)
	return err
}

// Empty reports whether the ring has no keys at all (neither flag).
func (r *Ring) Empty() bool { return r == nil || r.fileName == "" && r.dir == "" }

// AddRoot adds a folder (or a URL prefix) whose files are named, in
// --key-dir, by their path below it. Roots are tried in the order added.
func (r *Ring) AddRoot(root string) {
	if !isURL(root) {
		root = filepath.Clean(root)
	} else if !strings.HasSuffix(root, "/") {
		root += "/"
	}
	r.roots = append(r.roots, root)
}

// Close clears the key file's bytes; the ring gives no key after it.
func (r *Ring) Close() {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	clear(r.file)
	r.file, r.closed = nil, true
}

// Passphrase returns a fresh copy of the passphrase of the image file
// named file (as the qcow2 library names it: a path, or a URL), or nil if
// the ring has none for it. The caller owns the copy (and clears it).
// It is qcow2.Options.Passphrase.
func (r *Ring) Passphrase(file string) []byte {
	if r == nil {
		return nil
	}
	if path := r.dirFile(file); path != "" {
		b, err := ReadFile(path)
		switch {
		case err == nil:
			r.warnMode(path)
			return b
		case !errors.Is(err, fs.ErrNotExist):
			r.warnOnce(path, "key file not used: %v", err)
			return nil
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed || r.fileName == "" {
		return nil
	}
	return append(make([]byte, 0, len(r.file)), r.file...)
}

// Source says where the passphrase of file comes from, for messages: the
// flag and the file ("--key-dir file DIR/sub/vm.qcow2", "--key-file
// KEY"), or what would give it one when the ring has none.
func (r *Ring) Source(file string) string {
	if r == nil {
		return "give its passphrase with --key-file or --key-dir"
	}
	path := r.dirFile(file)
	if path != "" {
		if b, err := ReadFile(path); err == nil {
			clear(b)
			return "--key-dir file " + path
		} else if !errors.Is(err, fs.ErrNotExist) {
			return "--key-dir file " + path + ": " + err.Error()
		}
	}
	switch {
	case r.fileName != "":
		return "--key-file " + r.fileName
	case path != "":
		return "--key-dir has no " + path + "; give its passphrase there or with --key-file"
	case r.dir != "":
		return "it lies outside the source, so --key-dir does not name it; give its passphrase with --key-file"
	}
	return "give its passphrase with --key-file or --key-dir"
}

// NewlineHint says, for messages of a passphrase that opened none of
// file's key slots, that its key file ends in a newline, which is part of
// the passphrase (as qemu reads it too), and how to write one without;
// "" if it does not (or the ring has no passphrase for file).
func (r *Ring) NewlineHint(file string) string {
	p := r.Passphrase(file)
	defer clear(p)
	if len(p) == 0 || p[len(p)-1] != '\n' {
		return ""
	}
	return "the key file ends in a newline, which is part of the passphrase, as qemu reads it too; to leave it out, write the file with printf %s, not echo"
}

// dirFile is the --key-dir file that would hold file's passphrase, ""
// if there is no --key-dir or file lies under none of the roots.
func (r *Ring) dirFile(file string) string {
	if r.dir == "" {
		return ""
	}
	rel, ok := r.rel(file)
	if !ok {
		return ""
	}
	return filepath.Join(r.dir, filepath.FromSlash(rel))
}

// rel is file's path below the first root that holds it.
func (r *Ring) rel(file string) (string, bool) {
	if isURL(file) {
		if i := strings.IndexAny(file, "?#"); i >= 0 {
			file = file[:i]
		}
		for _, root := range r.roots {
			if rel, ok := strings.CutPrefix(file, root); ok && isRel(rel) {
				return rel, true
			}
		}
		return "", false
	}
	if !filepath.IsAbs(file) {
		abs, err := filepath.Abs(file)
		if err != nil {
			return "", false
		}
		file = abs
	}
	file = filepath.Clean(file)
	for _, root := range r.roots {
		if isURL(root) {
			continue
		}
		if rel, err := filepath.Rel(root, file); err == nil && isRel(rel) {
			return filepath.ToSlash(rel), true
		}
	}
	return "", false
}

// isRel reports whether rel is a path below a root: not empty, not
// climbing out of it.
func isRel(rel string) bool {
	return rel != "" && rel != "." && rel != ".." && !strings.HasPrefix(rel, "../") && !strings.Contains(rel, "/../")
}

func isURL(s string) bool {
	return strings.HasPrefix(s, "http://") || strings.HasPrefix(s, "https://") || strings.HasPrefix(s, "s3://")
}

// warnMode warns, once per file, of a key file others may read.
func (r *Ring) warnMode(path string) {
	if w := ModeWarning(path); w != "" {
		r.warnOnce(path, "%s", w)
	}
}

func (r *Ring) warnOnce(path, format string, args ...any) {
	if r.warnf == nil {
		return
	}
	r.mu.Lock()
	seen := r.warned[path]
	r.warned[path] = true
	r.mu.Unlock()
	if !seen {
		r.warnf(format, args...)
	}
}

// ModeWarning is the warning for a key file that is readable by group or
// others ("" if it is not, or cannot be statted).
func ModeWarning(path string) string {
	st, err := os.Stat(path)
	if err != nil || st.Mode().Perm()&0o044 == 0 {
		return ""
	}
	return fmt.Sprintf("key file %s is readable by group or others (mode %04o); chmod go-rwx %s", path, st.Mode().Perm(), path)
}

// DirWarnings are the ModeWarnings of the files in the key folder dir
// (recursively), at most max of them, with a last line counting the rest.
func DirWarnings(dir string, max int) []string {
	var out []string
	more := 0
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		if w := ModeWarning(p); w != "" {
			if len(out) < max {
				out = append(out, w)
			} else {
				more++
			}
		}
		return nil
	})
	if more > 0 {
		out = append(out, fmt.Sprintf("%d more key files in %s are readable by group or others", more, dir))
	}
	return out
}

// ReadFile reads the key file at path as qemu reads a secret's file=:
// its bytes exactly, trailing newline and all. It refuses what qemu
// refuses (bytes that are not valid UTF-8, a NUL byte) and a file of more
// than MaxBytes. The bytes are read into one buffer of their size (no
// copies left behind by a growing buffer); a file that is not regular (a
// pipe, /dev/stdin) is read through one buffer of MaxBytes+1, cleared.
func ReadFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return Read(f, path)
}

// Read is ReadFile of an open file; name is for messages.
func Read(f *os.File, name string) ([]byte, error) {
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	size := int64(MaxBytes + 1)
	if st.Mode().IsRegular() {
		size = min(size, st.Size()+1)
	} else if st.IsDir() {
		return nil, &os.PathError{Op: "read", Path: name, Err: syscall.EISDIR}
	}
	buf := make([]byte, size)
	n, err := readFull(f, buf)
	if err != nil {
		clear(buf)
		return nil, &os.PathError{Op: "read", Path: name, Err: err}
	}
	if n > MaxBytes {
		clear(buf)
		return nil, fmt.Errorf("key file %s: longer than %d bytes", name, MaxBytes)
	}
	if n == len(buf) {
		// A regular file that grew since it was statted: read again.
		clear(buf)
		if _, err := f.Seek(0, io.SeekStart); err != nil {
			return nil, err
		}
		return readGrown(f, name)
	}
	key := buf[:n:n]
	if err := Check(key); err != nil {
		clear(buf)
		return nil, fmt.Errorf("key file %s: %w", name, err)
	}
	if len(buf)-n > 1 {
		// Read through a large buffer (a pipe): keep only the key.
		key = append(make([]byte, 0, n), key...)
		clear(buf)
	}
	return key, nil
}

// readGrown reads a file that grew while it was read, through a buffer
// of MaxBytes+1.
func readGrown(f *os.File, name string) ([]byte, error) {
	buf := make([]byte, MaxBytes+1)
	defer clear(buf)
	n, err := readFull(f, buf)
	if err != nil {
		return nil, &os.PathError{Op: "read", Path: name, Err: err}
	}
	if n > MaxBytes {
		return nil, fmt.Errorf("key file %s: longer than %d bytes", name, MaxBytes)
	}
	if err := Check(buf[:n]); err != nil {
		return nil, fmt.Errorf("key file %s: %w", name, err)
	}
	return append(make([]byte, 0, n), buf[:n]...), nil
}

// readFull reads until buf is full or the end of the file.
func readFull(f *os.File, buf []byte) (int, error) {
	n := 0
	for n < len(buf) {
		m, err := f.Read(buf[n:])
		n += m
		if err == io.EOF {
			return n, nil
		}
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// Check says why qemu would refuse key as a secret: bytes that are not
// UTF-8, or a NUL byte (g_utf8_validate with a length refuses it).
func Check(key []byte) error {
	if i := bytes.IndexByte(key, 0); i >= 0 {
		return fmt.Errorf("a NUL byte at offset %d: qemu refuses such a secret (\"not valid UTF-8\"), so no image it made has this passphrase", i)
	}
	if !utf8.Valid(key) {
		return errors.New("not valid UTF-8: qemu refuses such a secret, so no image it made has this passphrase")
	}
	return nil
}
