package qcow2

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// Host files: the files an image is made of (the image file, its external
// data file, its backing files), and the one type through which the library
// reads an image file's metadata.
//
// A HostFile is anything that reads like a file: a local file (the default
// opener), an object on a web server or in a bucket (package remote), a
// buffer in a test. Optional capabilities are found by type assertion: a
// file descriptor (zero-copy reads, locks, host-hole probing) through Fd,
// and an identity for loop detection through ID.
//
// metaFile is what crosvm's qcow_raw_file is: every read of the header
// cluster, L1 tables, L2 tables, refcount tables and blocks, the snapshot
// table and the bitmap tables goes through it, with the big-endian table
// decoding written once. Reads must be complete: a host file that returns
// fewer bytes than asked for inside the size it had at open (it was
// truncated while open) is an error, never a buffer half filled with
// whatever it held before.

// A HostFile is one file of an image.
type HostFile interface {
	io.ReaderAt
	// Size returns the file's current size in bytes.
	Size() (int64, error)
	// Name names the file in messages, and is the base against which
	// the default opener resolves relative backing file names.
	Name() string
	Close() error
}

// A WritableFile is a HostFile the writer can change: the image file, and
// its external data file, of an image opened for writing. Everything the
// writer does to the host goes through these methods, so that a test can
// record it, replay it, or make it fail.
type WritableFile interface {
	HostFile
	io.WriterAt
	// Sync makes everything written before it durable (fdatasync).
	Sync() error
	// Truncate sets the file's size.
	Truncate(size int64) error
	// Allocate reserves [off, off+n), growing the file if needed
	// (fallocate mode 0): the range reads as zeros where it was not
	// written.
	Allocate(off, n int64) error
	// Punch deallocates [off, off+n) without changing the size
	// (fallocate PUNCH_HOLE|KEEP_SIZE): the range then reads as zeros.
	Punch(off, n int64) error
}

// writebacker is a WritableFile that can start writing a range back to
// its disk early (localFile). Large sequential writes use it, so that the
// disk works while the next writes arrive instead of all at the fsync.
type writebacker interface {
	StartWriteback(off, n int64) error
}

// fdFile is a HostFile backed by a file descriptor.
type fdFile interface {
	Fd() uintptr
}

// identified is a HostFile that knows its identity, so that a backing
// chain looping back onto one of its files is refused. Files without it
// are told apart by name.
type identified interface {
	ID() any
}

// fileOf returns the *os.File behind f, if there is one.
func fileOf(f HostFile) *os.File {
	if lf, ok := f.(*localFile); ok {
		return lf.File
	}
	return nil
}

// localFile is a HostFile on a local file.
type localFile struct {
	*os.File
	id     fileID
	direct direct // direct.go
}

type fileID struct{ dev, ino uint64 }

func (f *localFile) ID() any { return f.id }

func (f *localFile) Size() (int64, error) {
	// Seek rather than stat, so that block devices report their size
	// (they are only opened when a caller passes one in).
	size, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return 0, fmt.Errorf("%s: size: %w", f.Name(), err)
	}
	return size, nil
}

// Sync is fdatasync(2): data and the metadata needed to read it back.
func (f *localFile) Sync() error {
	for {
		err := unix.Fdatasync(int(f.Fd()))
		if err != unix.EINTR {
			if err != nil {
				return &os.PathError{Op: "fdatasync", Path: f.Name(), Err: err}
			}
			return nil
		}
	}
}

// StartWriteback asks the kernel to start writing [off, off+n) to the
// disk now, without waiting for it (sync_file_range SYNC_FILE_RANGE_WRITE
// alone): it promises nothing about durability, and leaves the file's
// error state for the next fdatasync to report (only the waiting flags
// consume it).
func (f *localFile) StartWriteback(off, n int64) error {
	return unix.SyncFileRange(int(f.Fd()), off, n, unix.SYNC_FILE_RANGE_WRITE)
}

// Allocate is fallocate(2) mode 0.
func (f *localFile) Allocate(off, n int64) error {
	if err := unix.Fallocate(int(f.Fd()), 0, off, n); err != nil {
		return &os.PathError{Op: "fallocate", Path: f.Name(), Err: err}
	}
	return nil
}

// Punch is fallocate(2) PUNCH_HOLE|KEEP_SIZE.
func (f *localFile) Punch(off, n int64) error {
	if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n); err != nil {
		return &os.PathError{Op: "fallocate punch", Path: f.Name(), Err: err}
	}
	return nil
}

// OpenFile opens the local file at path, read-only, as a HostFile. The open
// never blocks (O_NONBLOCK: a fifo does not hang it).
func OpenFile(path string) (HostFile, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_NOCTTY, 0)
	if err != nil {
		return nil, err
	}
	return newLocalFile(f)
}

// OpenWritableFile opens the local file at path for reading and writing.
func OpenWritableFile(path string) (WritableFile, error) {
	f, err := os.OpenFile(path, os.O_RDWR|syscall.O_NONBLOCK|syscall.O_NOCTTY, 0)
	if err != nil {
		return nil, err
	}
	return newLocalFile(f)
}

// NewFile wraps an opened local file as a HostFile (a WritableFile if f was
// opened for writing); the HostFile owns f.
func NewFile(f *os.File) (HostFile, error) { return newLocalFile(f) }

func newLocalFile(f *os.File) (*localFile, error) {
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		f.Close()
		return nil, fmt.Errorf("%s: %w", f.Name(), err)
	}
	return &localFile{File: f, id: fileID{dev: st.Dev, ino: st.Ino}}, nil
}

// readerFile is a HostFile over an io.ReaderAt of known size.
type readerFile struct {
	io.ReaderAt
	size int64
	name string
}

func (r *readerFile) Size() (int64, error) { return r.size, nil }
func (r *readerFile) Name() string         { return r.name }
func (r *readerFile) Close() error {
	if c, ok := r.ReaderAt.(io.Closer); ok {
		return c.Close()
	}
	return nil
}

// ReaderFile makes a HostFile of r, size bytes long, named name. Closing
// it closes r if r is an io.Closer.
func ReaderFile(r io.ReaderAt, size int64, name string) HostFile {
	return &readerFile{ReaderAt: r, size: size, name: name}
}

// readFull reads len(p) bytes at off from f, failing unless all of them
// arrive. what names the structure read, for the message.
func readFull(f HostFile, p []byte, off int64, what string) error {
	n, err := f.ReadAt(p, off)
	if n == len(p) {
		return nil
	}
	if err == nil || errors.Is(err, io.EOF) {
		err = ErrShortRead
	}
	return fmt.Errorf("%s: reading %s (%d bytes at byte offset %d, got %d): %w", f.Name(), what, len(p), off, n, err)
}

// metaFile reads an image file's metadata. size is the file's size at open:
// tables are checked against it before they are read.
type metaFile struct {
	f           HostFile
	size        int64
	clusterSize int64
}

func (m *metaFile) name() string { return m.f.Name() }

// read reads len(p) bytes at off, all of them.
func (m *metaFile) read(p []byte, off int64, what string) error {
	return readFull(m.f, p, off, what)
}

// words reads n big-endian 64-bit words at off: an L1 table, a refcount
// table, a bitmap table.
func (m *metaFile) words(off int64, n int64, what string) ([]uint64, error) {
	buf := make([]byte, n*8)
	if err := m.read(buf, off, what); err != nil {
		return nil, err
	}
	t := make([]uint64, n)
	decodeWords(t, buf)
	return t, nil
}

// table reads the cluster at off as big-endian words: an L2 table or a
// refcount block.
func (m *metaFile) table(off int64, what string) ([]uint64, error) {
	return m.words(off, m.clusterSize/8, what)
}

// putWord puts v at the start of b, big-endian, as tables hold words.
func putWord(b []byte, v uint64) {
	_ = b[7]
	b[0], b[1], b[2], b[3] = byte(v>>56), byte(v>>48), byte(v>>40), byte(v>>32)
	b[4], b[5], b[6], b[7] = byte(v>>24), byte(v>>16), byte(v>>8), byte(v)
}

// encodeWords encodes src as big-endian 64-bit words into dst
// (len(dst) >= 8*len(src)).
func encodeWords(dst []byte, src []uint64) {
	for i, w := range src {
		binary.BigEndian.PutUint64(dst[i*8:], w)
	}
}

// decodeWords decodes big-endian 64-bit words from src into dst
// (len(src) >= 8*len(dst)).
func decodeWords(dst []uint64, src []byte) {
	for i := range dst {
		dst[i] = binary.BigEndian.Uint64(src[i*8:])
	}
}
