package qcow2

import (
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Large data writes bypass the host's page cache.
//
// A guest streaming data (a 1 MiB dd, a copy inside the guest file system)
// would otherwise have every byte copied into freshly allocated page-cache
// pages of the image file, a copy that costs more than the rest of the
// write path together on these machines, and then written back to the disk
// only at the fsync. Written with O_DIRECT instead, the bytes go from one
// reused buffer to the disk, as the raw file's own O_DIRECT writes do.
//
// Only data clusters are written so: whole 4 KiB blocks (offset, length
// and buffer), at least directMin bytes; metadata, small and unaligned
// writes stay buffered. The kernel keeps the two coherent (a direct write
// writes back and drops the cached pages of its range), and durability is
// unchanged: a direct write, like a buffered one, is durable only after the
// next fdatasync, which Flush issues before any metadata names the data.

// directMin is the smallest data write made with O_DIRECT.
const directMin = 256 << 10

// directAlign is the alignment of a direct write's offset, length and
// buffer: 4 KiB, the logical block size of any disk worth the name (and a
// multiple of the 512 bytes of the others).
const directAlign = 4096

// directWriter is a WritableFile that can write with O_DIRECT (localFile).
type directWriter interface {
	// CanWriteDirect reports whether WriteDirect can be used (the file
	// system takes O_DIRECT opens).
	CanWriteDirect() bool
	// WriteDirect writes b, aligned in memory, at off bypassing the page
	// cache (or buffered, if the file system refuses these writes).
	WriteDirect(b []byte, off int64) error
}

// direct is a file's second descriptor, opened with O_DIRECT on first use.
type direct struct {
	once sync.Once
	f    *os.File    // nil: the file system refuses O_DIRECT
	off  atomic.Bool // a direct write failed with EINVAL: stay buffered
}

// CanWriteDirect opens the file's O_DIRECT descriptor on first use, again
// from the file's own (/proc/self/fd), so that it is the same file
// whatever happened to its name.
func (f *localFile) CanWriteDirect() bool {
	d := &f.direct
	d.once.Do(func() {
		path := fmt.Sprintf("/proc/self/fd/%d", f.Fd())
		if df, err := os.OpenFile(path, os.O_WRONLY|unix.O_DIRECT|unix.O_NOCTTY, 0); err == nil {
			d.f = df
		}
	})
	return d.f != nil && !d.off.Load()
}

// WriteDirect writes b at off through the O_DIRECT descriptor.
func (f *localFile) WriteDirect(b []byte, off int64) error {
	d := &f.direct
	if !f.CanWriteDirect() {
		_, err := f.File.WriteAt(b, off)
		return err
	}
	for len(b) > 0 {
		n, err := unix.Pwrite(int(d.f.Fd()), b, off)
		switch {
		case err == unix.EINTR:
			continue
		case err == unix.EINVAL && n <= 0:
			// This file system takes O_DIRECT opens but not these
			// writes: buffered from now on, this one included.
			d.off.Store(true)
			if _, err := f.File.WriteAt(b, off); err != nil {
				return err
			}
			return nil
		case err != nil:
			return &os.PathError{Op: "write", Path: f.Name(), Err: err}
		case n == 0:
			return &os.PathError{Op: "write", Path: f.Name(), Err: unix.EIO}
		}
		b, off = b[n:], off+int64(n)
	}
	return nil
}

// Close closes the file and its direct descriptor.
func (f *localFile) Close() error {
	if f.direct.f != nil {
		f.direct.f.Close()
	}
	return f.File.Close()
}

// directFor returns the direct writer of df if a data write of b at off
// goes to the host with O_DIRECT: whole 4 KiB blocks, at least directMin
// bytes, on a file system that takes O_DIRECT opens. The host door
// (hostwrite.go, writeBehind) makes the write.
func directFor(df WritableFile, b []byte, off int64) (directWriter, bool) {
	dw, ok := df.(directWriter)
	return dw, ok && len(b) >= directMin && off%directAlign == 0 && len(b)%directAlign == 0 && dw.CanWriteDirect()
}

// behindSmall is the largest write left in flight behind others.
const behindSmall = 64 << 10

func aligned(b []byte) bool { return uintptr(unsafe.Pointer(&b[0]))%directAlign == 0 }
