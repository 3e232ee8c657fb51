package fat

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"sync"
	"syscall"

	"github.com/qcowfs/qcowfs/guestfs"
)

// File is a regular file opened from an FS: its bytes are its chain's
// clusters, all of them data (FAT has no holes).
type File struct {
	fs   *FS
	name string
	st   guestfs.Stat
	ch   *chain // nil for an empty file

	mu  sync.Mutex // guards off
	off int64
}

var _ guestfs.File = (*File)(nil)

// OpenIno opens regular file ino. Its chain is checked to hold its size
// here, so that a file whose DIR_FileSize runs past its chain fails to
// open rather than part way through a read (Linux fails the read there,
// with EIO).
func (f *FS) OpenIno(ino uint64) (guestfs.File, error) {
	return f.openIno(ino, "")
}

func (f *FS) openIno(ino uint64, name string) (*File, error) {
	if ino == rootIno {
		return nil, fmt.Errorf("vfat: inode %d: %w", ino, errIsDir)
	}
	_, e, err := f.entry(ino)
	if err != nil {
		return nil, err
	}
	if e.isDir() {
		return nil, fmt.Errorf("vfat: inode %d: %w", ino, errIsDir)
	}
	if name == "" {
		name = e.name()
	}
	file := &File{fs: f, name: name, st: f.stat(ino, e, nil)}
	if e.FileSize == 0 {
		return file, nil
	}
	if !f.validCluster(e.FstClus) {
		return nil, &guestfs.FormatError{FS: fsType, Inode: ino, Field: "DIR_FstClus", Value: uint64(e.FstClus),
			Msg: fmt.Sprintf("not a cluster of the data area (2 to %d), for a file of %d bytes", f.g.maxCluster-1, e.FileSize)}
	}
	file.ch = f.chain(e.FstClus)
	need := uint32((int64(e.FileSize) + f.g.clusterSize - 1) / f.g.clusterSize)
	if _, _, err := file.ch.lookup(need-1, need-1); err != nil {
		if errors.Is(err, errPastChain) {
			return nil, &guestfs.FormatError{FS: fsType, Inode: ino, Field: "DIR_FileSize", Value: uint64(e.FileSize),
				Msg: fmt.Sprintf("needs %d clusters; the chain from cluster %d has fewer", need, e.FstClus)}
		}
		return nil, withInode(err, ino)
	}
	return file, nil
}

// ReadAt reads len(p) bytes at off, or up to the end of the file with
// io.EOF.
func (fl *File) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, &fs.PathError{Op: "read", Path: fl.name, Err: fs.ErrInvalid}
	}
	size := fl.st.Size
	if off >= size {
		return 0, io.EOF
	}
	want := p
	if int64(len(p)) > size-off {
		want = p[:size-off]
	}
	cs := fl.fs.g.clusterSize
	last := uint32((off + int64(len(want)) - 1) / cs)
	n := 0
	for n < len(want) {
		pos := off + int64(n)
		disk, contig, err := fl.ch.lookup(uint32(pos/cs), last)
		if err != nil {
			if errors.Is(err, errPastChain) {
				err = &guestfs.FormatError{FS: fsType, Inode: fl.st.Ino, Field: "DIR_FileSize", Value: uint64(size),
					Msg: fmt.Sprintf("past the end of the file's cluster chain at byte %d", pos)}
			}
			return n, withInode(err, fl.st.Ino)
		}
		span := int64(contig)*cs - pos%cs
		k := int(min(span, int64(len(want)-n)))
		if err := fl.fs.readAt(want[n:n+k], fl.fs.g.clusterOffset(disk)+pos%cs); err != nil {
			return n, withInode(err, fl.st.Ino)
		}
		n += k
	}
	if len(want) < len(p) {
		return n, io.EOF
	}
	return n, nil
}

func (fl *File) Read(p []byte) (int, error) {
	fl.mu.Lock()
	defer fl.mu.Unlock()
	n, err := fl.ReadAt(p, fl.off)
	fl.off += int64(n)
	if err == io.EOF && n > 0 {
		err = nil
	}
	return n, err
}

// Seek also takes whence 3 (SEEK_DATA) and 4 (SEEK_HOLE), as lseek(2):
// the whole file is data, its end the only hole, and an offset at or past
// the end is ENXIO for both.
func (fl *File) Seek(offset int64, whence int) (int64, error) {
	fl.mu.Lock()
	defer fl.mu.Unlock()
	var pos int64
	switch whence {
	case io.SeekStart:
		pos = offset
	case io.SeekCurrent:
		pos = fl.off + offset
	case io.SeekEnd:
		pos = fl.st.Size + offset
	case 3, 4:
		if offset < 0 || offset >= fl.st.Size {
			return 0, &fs.PathError{Op: "seek", Path: fl.name, Err: syscall.ENXIO}
		}
		pos = offset
		if whence == 4 {
			pos = fl.st.Size
		}
	default:
		return 0, &fs.PathError{Op: "seek", Path: fl.name, Err: fs.ErrInvalid}
	}
	if pos < 0 {
		return 0, &fs.PathError{Op: "seek", Path: fl.name, Err: fs.ErrInvalid}
	}
	fl.off = pos
	return pos, nil
}

// NextData returns off itself below the end of the file: FAT files are
// all data.
func (fl *File) NextData(off int64) (int64, error) {
	if off < 0 {
		return 0, fs.ErrInvalid
	}
	if off >= fl.st.Size {
		return 0, io.EOF
	}
	return off, nil
}

// NextHole returns the end of the file, the only hole.
func (fl *File) NextHole(off int64) (int64, error) {
	if off < 0 {
		return 0, fs.ErrInvalid
	}
	if off > fl.st.Size {
		return 0, io.EOF
	}
	return fl.st.Size, nil
}

func (fl *File) Stat() (fs.FileInfo, error) { return &fileInfo{fl.name, fl.st}, nil }

func (fl *File) Close() error { return nil }
