package ext4

import (
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"math"
	"sync"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/guestfs"
)

// file is an open regular file (or an empty device node, FIFO or socket).
// ReadAt, NextData and NextHole keep no state but last, the run the last
// read mapped, so that reads one after another map each run once; the
// offset of Read and Seek is guarded by mu.
type file struct {
	fs   *FS
	in   *inode
	name string
	last atomic.Pointer[run]
	// small holds the block the last read smaller than a block read
	// whole, so that reads of a few bytes at a time do not each cost a
	// read of the disk.
	small atomic.Pointer[fileBlock]

	mu     sync.Mutex
	off    int64
	closed bool
}

var _ guestfs.File = (*file)(nil)

// size is what reads see: i_size for regular files (and symbolic links,
// read through here), nothing for device nodes, FIFOs and sockets.
func (f *file) size() int64 {
	switch f.in.fileType() {
	case unix.S_IFREG, unix.S_IFLNK:
		return int64(f.in.size)
	}
	return 0
}

func (f *file) Stat() (iofs.FileInfo, error) {
	return &fileInfo{name: f.name, st: f.fs.stat(f.in)}, nil
}

func (f *file) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return iofs.ErrClosed
	}
	f.closed = true
	return nil
}

func (f *file) Read(p []byte) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return 0, iofs.ErrClosed
	}
	n, err := f.ReadAt(p, f.off)
	f.off += int64(n)
	if n > 0 && err == io.EOF {
		err = nil
	}
	return n, err
}

// ReadAt reads the file's bytes at off: from the blocks its extents or
// block map name, zeros from holes and unwritten extents, or its inline
// data. Every run is mapped as it is reached, so a read costs what the
// part of the file it covers costs, whatever the file's size.
func (f *file) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("%s: inode %d: negative offset %d: %w", f.fs.typ, f.in.ino, off, syscall.EINVAL)
	}
	size := f.size()
	if off >= size {
		return 0, io.EOF
	}
	want := int(min(int64(len(p)), size-off))
	if f.in.flags&flagInlineData != 0 {
		n := f.readInline(p[:want], off)
		if n < len(p) {
			return n, io.EOF
		}
		return n, nil
	}
	bs := int64(f.fs.sb.BlockSize)
	n := 0
	for n < want {
		pos := off + int64(n)
		r, err := f.mapBlock(uint64(pos / bs))
		if err != nil {
			return n, err
		}
		// The bytes of the run from pos on, bounded by what is wanted.
		inRun := uint64(math.MaxInt64)
		if left := r.lblk + r.n - uint64(pos/bs); left < inRun/uint64(bs) {
			inRun = left*uint64(bs) - uint64(pos%bs)
		}
		chunk := int(min(uint64(want-n), inRun))
		if r.data() {
			disk := int64(r.pblk)*bs + pos - int64(r.lblk)*bs
			if err := f.readData(p[n:n+chunk], disk, pos+int64(chunk) == size); err != nil {
				return n, fmt.Errorf("%s: inode %d: %w", f.fs.typ, f.in.ino, err)
			}
		} else {
			clear(p[n : n+chunk])
		}
		n += chunk
	}
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

type fileBlock struct {
	pblk uint64
	data []byte
}

// readData reads p from byte disk of the file system, a part of one of
// the file's runs: straight into p, or if p is less than half a block
// within one block and does not reach the end of the file (toEOF), where
// more small reads are likely, through f.small.
func (f *file) readData(p []byte, disk int64, toEOF bool) error {
	bs := int64(f.fs.sb.BlockSize)
	pblk := uint64(disk / bs)
	if toEOF || int64(len(p)) >= bs/2 || (disk+int64(len(p))-1)/bs != disk/bs {
		return f.fs.dev.readAt(p, disk)
	}
	b := f.small.Load()
	if b == nil || b.pblk != pblk {
		b = &fileBlock{pblk: pblk, data: make([]byte, bs)}
		if err := f.fs.dev.readBlocks(b.data, pblk); err != nil {
			return err
		}
		f.small.Store(b)
	}
	copy(p, b.data[disk%bs:])
	return nil
}

// mapBlock maps lblk, through the run the last call mapped if it holds it.
func (f *file) mapBlock(lblk uint64) (run, error) {
	if r := f.last.Load(); r != nil && lblk >= r.lblk && lblk-r.lblk < r.n {
		return *r, nil
	}
	r, err := f.fs.mapBlock(f.in, lblk)
	if err == nil {
		f.last.Store(&r)
	}
	return r, err
}

// readInline copies inline data at off: the first 60 bytes are in
// i_block, the rest in system.data; past both (a file whose size says
// more) reads as zeros, as the kernel reads it.
func (f *file) readInline(p []byte, off int64) int {
	for i := range p {
		pos := off + int64(i)
		switch {
		case pos < iBlockLen:
			p[i] = f.in.block[pos]
		case pos-iBlockLen < int64(len(f.in.inlineData)):
			p[i] = f.in.inlineData[pos-iBlockLen]
		default:
			p[i] = 0
		}
	}
	return len(p)
}

// NextData returns the first offset at or after off that holds data (an
// extent that is written, a block pointer), or io.EOF if none does before
// the end of the file, as lseek(SEEK_DATA) on the kernel's mount.
func (f *file) NextData(off int64) (int64, error) {
	return f.seekRun(off, true)
}

// NextHole returns the first offset at or after off in a hole (none
// mapped, or unwritten), the end of the file if none is before it, or
// io.EOF if off is at or past the end, as lseek(SEEK_HOLE).
func (f *file) NextHole(off int64) (int64, error) {
	return f.seekRun(off, false)
}

func (f *file) seekRun(off int64, data bool) (int64, error) {
	size := f.size()
	if off < 0 {
		return 0, fmt.Errorf("%s: inode %d: negative offset %d: %w", f.fs.typ, f.in.ino, off, syscall.EINVAL)
	}
	if off >= size {
		return 0, io.EOF
	}
	if f.in.flags&flagInlineData != 0 {
		if data {
			return off, nil
		}
		return size, nil
	}
	bs := int64(f.fs.sb.BlockSize)
	for off < size {
		r, err := f.fs.mapBlock(f.in, uint64(off/bs))
		if err != nil {
			return 0, err
		}
		if r.data() == data {
			return off, nil
		}
		end := r.lblk + r.n
		if end > uint64(math.MaxInt64/bs) || int64(end)*bs >= size {
			break
		}
		off = int64(end) * bs
	}
	if data {
		return 0, io.EOF
	}
	return size, nil
}

// Seek sets the offset of Read: whence io.SeekStart, io.SeekCurrent,
// io.SeekEnd, or 3 (SEEK_DATA) and 4 (SEEK_HOLE), which fail with ENXIO
// where lseek(2) does: at or past the end, or for SEEK_DATA, in a hole
// that runs to the end.
func (f *file) Seek(offset int64, whence int) (int64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return 0, iofs.ErrClosed
	}
	var pos int64
	var err error
	switch whence {
	case io.SeekStart:
		pos = offset
	case io.SeekCurrent:
		pos = f.off + offset
	case io.SeekEnd:
		pos = f.size() + offset
	case unix.SEEK_DATA:
		pos, err = f.NextData(offset)
	case unix.SEEK_HOLE:
		pos, err = f.NextHole(offset)
	default:
		return 0, fmt.Errorf("seek whence %d: %w", whence, syscall.EINVAL)
	}
	if errors.Is(err, io.EOF) {
		err = fmt.Errorf("seek to %d: %w", offset, syscall.ENXIO)
	}
	if err != nil {
		return 0, err
	}
	if pos < 0 {
		return 0, fmt.Errorf("seek to %d: %w", pos, syscall.EINVAL)
	}
	f.off = pos
	return pos, nil
}
