// Package guestfs reads the file systems inside a guest's disk: ext2/3/4
// (guestfs/ext4) and FAT12/16/32 (guestfs/fat), as Go's io/fs file systems
// over an io.ReaderAt of one partition, without the kernel, root or a VM.
//
// A guest file system is untrusted input from whoever made the image:
// every structure is bounded where it is read, every walk is bounded in
// depth and work, and nothing is read outside the partition's bytes. A
// damaged structure is a *FormatError that wraps ErrCorrupt.
//
// It knows nothing of qcow2 or FUSE: the caller hands it the partition's
// bytes (a qcow2.Image seen through an io.SectionReader, say).
package guestfs

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"time"
)

// Sentinel errors, for errors.Is.
var (
	// ErrCorrupt: a structure of the file system is malformed.
	ErrCorrupt = errors.New("corrupt file system")
	// ErrUnsupported: a file system, or a feature of one, this package
	// does not read.
	ErrUnsupported = errors.New("unsupported file system")
)

// FormatError says what is malformed, where: the file system, the inode
// (0 for file-system-wide structures), the field and its value.
type FormatError struct {
	FS    string // "ext4", "vfat", ...
	Inode uint64
	Field string
	Value uint64
	Msg   string
}

func (e *FormatError) Error() string {
	if e.Inode != 0 {
		return fmt.Sprintf("%s: inode %d: %s %d: %s", e.FS, e.Inode, e.Field, e.Value, e.Msg)
	}
	return fmt.Sprintf("%s: %s %d: %s", e.FS, e.Field, e.Value, e.Msg)
}

func (e *FormatError) Unwrap() error { return ErrCorrupt }

// Stat is what fs.FileInfo.Sys returns for every file of a guest file
// system, as a value (info.Sys().(guestfs.Stat)): the inode as the guest
// stores it.
type Stat struct {
	Ino                        uint64 // inode number (FAT: stable, from the entry's place on disk)
	Nlink                      uint32
	Mode                       uint32 // st_mode as Linux shows it: S_IFMT type bits and 07777
	Uid, Gid                   uint32
	Rdev                       uint64 // device nodes: unix.Mkdev(major, minor)
	Size                       int64
	Blocks                     int64 // 512-byte units allocated (st_blocks)
	Atime, Mtime, Ctime, Btime time.Time
}

// DirEntry is one entry of a directory, by inode.
type DirEntry struct {
	Name string
	Ino  uint64
	Type uint32 // S_IFMT bits of the entry's inode (0 when the file system does not say)
}

// FS is a guest file system. Paths go through io/fs (Open follows
// symbolic links, a bounded number of hops and never out of the file
// system; Lstat and ReadLink do not); the inode methods serve a caller
// that keeps inode numbers, as a FUSE server does, without resolving a
// path per request. An FS is safe for concurrent use.
type FS interface {
	fs.ReadDirFS
	fs.StatFS
	fs.ReadLinkFS

	Type() string  // "ext2", "ext3", "ext4", "vfat"
	Label() string // the volume label, "" if none
	RootIno() uint64

	StatIno(ino uint64) (Stat, error)
	Lookup(dir uint64, name string) (Stat, error)
	ReadDirIno(dir uint64) ([]DirEntry, error)
	ReadLinkIno(ino uint64) (string, error)
	// OpenIno opens a regular file. A device node, FIFO or socket opens
	// as a File of size 0 (its Stat still says what it is); a directory
	// or symbolic link is an error.
	OpenIno(ino uint64) (File, error)
}

// File is a regular file opened from an FS.
type File interface {
	fs.File
	io.ReaderAt
	// Seek takes whence 3 (SEEK_DATA) and 4 (SEEK_HOLE) as lseek(2)
	// does, besides io.SeekStart, io.SeekCurrent and io.SeekEnd.
	io.Seeker
	// NextData returns the first offset at or after off that holds data,
	// or io.EOF if there is none before the end of the file.
	NextData(off int64) (int64, error)
	// NextHole returns the first offset at or after off in a hole; the
	// end of the file is one.
	NextHole(off int64) (int64, error)
}
