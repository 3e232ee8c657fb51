package fiemap

import (
	"errors"
	"fmt"
	"slices"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The FS_IOC_FIEMAP interface, from include/uapi/linux/fiemap.h
// (golang.org/x/sys/unix does not define it). Field names follow the C
// structures.

// fsIocFiemap is _IOWR('f', 11, struct fiemap); the same number on every
// Linux architecture.
const fsIocFiemap = 0xC020660B

// fiemapHeader is struct fiemap, without its flexible fm_extents array.
type fiemapHeader struct {
	fmStart         uint64 // logical offset (inclusive) at which to start mapping (in)
	fmLength        uint64 // logical length of mapping which userspace wants (in)
	fmFlags         uint32 // FIEMAP_FLAG_* flags for request (in/out)
	fmMappedExtents uint32 // number of extents that were mapped (out)
	fmExtentCount   uint32 // size of fm_extents array (in)
	fmReserved      uint32
}

// fiemapExtent is struct fiemap_extent.
type fiemapExtent struct {
	feLogical    uint64 // logical offset in bytes for the start of the extent
	fePhysical   uint64 // physical offset in bytes for the start of the extent
	feLength     uint64 // length in bytes for the extent
	feReserved64 [2]uint64
	feFlags      uint32 // FIEMAP_EXTENT_* flags for this extent
	feReserved   [3]uint32
}

const (
	fiemapHeaderSize = 32
	fiemapExtentSize = 56
)

// The layout must match the kernel's.
var (
	_ [fiemapHeaderSize]byte = [unsafe.Sizeof(fiemapHeader{})]byte{}
	_ [fiemapExtentSize]byte = [unsafe.Sizeof(fiemapExtent{})]byte{}
)

// fe_flags bits a Map looks at. The others (UNKNOWN, ENCODED,
// DATA_ENCRYPTED, NOT_ALIGNED, DATA_INLINE, DATA_TAIL, MERGED, SHARED)
// describe where or how data is stored; an extent carrying them is data.
const (
	fiemapFlagSync        = 0x00000001 // write dirty pages back before mapping
	fiemapExtentLast      = 0x00000001 // last extent of the mapped range
	fiemapExtentDelalloc  = 0x00000004 // location not allocated yet: dirty data
	fiemapExtentUnwritten = 0x00000800 // space allocated, but no data (reads zeros)
)

// errBadReply means the kernel's answer cannot be right (more extents than
// asked for, no progress); the Map then stops trusting the call.
var errBadReply = errors.New("inconsistent reply")

// fiemapWindow describes [off, limit), or a prefix of it, with one
// FS_IOC_FIEMAP call asking for up to m.windowExtents extents, plus an
// lseek check of each unwritten extent (see the package comment). fillMu
// must be held.
func (m *Map) fiemapWindow(off, limit int64) (*window, error) {
	n := m.windowExtents
	if m.buf == nil {
		m.buf = make([]uint64, (fiemapHeaderSize+n*fiemapExtentSize)/8)
	}
	m.fiemaps.Add(1)
	flags := uint32(0)
	if m.sync {
		flags = fiemapFlagSync
	}
	exts, err := fiemap(m.rc, m.buf, off, limit-off, flags)
	if err != nil {
		return nil, m.ioctlError(off, err)
	}
	mapped := len(exts)
	// With fewer extents than asked for, or the last one flagged LAST
	// (the last of the range, as iomap_fiemap flags it), the reply covers
	// the whole range. Otherwise more extents may follow the last one
	// returned, and what is known ends with it.
	end := limit
	if mapped == n && n > 0 && exts[n-1].feFlags&fiemapExtentLast == 0 {
		_, end = clip(&exts[n-1], off, limit)
		if end <= off {
			return nil, m.ioctlError(off, fmt.Errorf("last extent [%d, +%d) ends before the range [%d, %d): %w",
				exts[n-1].feLogical, exts[n-1].feLength, off, limit, errBadReply))
		}
	}

	// Extents come sorted by logical offset. A window holds at most room
	// runs: only the lseek check of unwritten extents can split one
	// extent into several, and room stops a window from growing without
	// bound when dirty pages are scattered over a large unwritten extent.
	room := 2 * n
	runs := m.scr[:0]
	for i := range exts {
		e := &exts[i]
		s, t := clip(e, off, end)
		if s >= t {
			continue
		}
		if len(runs) >= room {
			end = s
			break
		}
		if e.feFlags&(fiemapExtentUnwritten|fiemapExtentDelalloc) != fiemapExtentUnwritten {
			runs = appendRun(runs, s, t)
			continue
		}
		if m.sync {
			continue // written back: an unwritten extent reads zeros
		}
		var upTo int64
		var err error
		runs, upTo, err = m.seekRuns(runs, s, t, room-len(runs))
		if err != nil {
			return nil, err
		}
		if upTo < t {
			end = upTo
			break
		}
	}
	m.scr = runs
	return &window{start: off, end: end, runs: slices.Clone(runs)}, nil
}

// fiemap makes one FS_IOC_FIEMAP call for [start, start+length) on rc's
// descriptor, with buf (a header and room for n extents) as its argument,
// and returns the extents mapped, which live in buf.
func fiemap(rc syscall.RawConn, buf []uint64, start, length int64, flags uint32) ([]fiemapExtent, error) {
	n := (len(buf)*8 - fiemapHeaderSize) / fiemapExtentSize
	hdr := (*fiemapHeader)(unsafe.Pointer(&buf[0]))
	*hdr = fiemapHeader{fmStart: uint64(start), fmLength: uint64(length), fmFlags: flags, fmExtentCount: uint32(n)}
	var errno syscall.Errno
	if err := rc.Control(func(fd uintptr) {
		_, _, errno = unix.Syscall(unix.SYS_IOCTL, fd, fsIocFiemap, uintptr(unsafe.Pointer(hdr)))
	}); err != nil {
		return nil, err
	}
	if errno != 0 {
		return nil, errno
	}
	mapped := int(hdr.fmMappedExtents)
	if mapped > n {
		return nil, fmt.Errorf("%d extents mapped, %d asked for: %w", mapped, n, errBadReply)
	}
	return unsafe.Slice((*fiemapExtent)(unsafe.Pointer(&buf[fiemapHeaderSize/8])), n)[:mapped], nil
}

// ioctlError wraps err from the FIEMAP call at off with what and where.
func (m *Map) ioctlError(off int64, err error) error {
	return fmt.Errorf("fiemap: %s: FS_IOC_FIEMAP from offset %d: %w", m.name, off, err)
}

// clip returns extent e's byte range clipped to [off, limit).
func clip(e *fiemapExtent, off, limit int64) (s, t int64) {
	lo, hi := e.feLogical, e.feLogical+e.feLength
	if hi < lo { // wrapped around
		hi = 1<<64 - 1
	}
	s, t = off, limit
	if lo > uint64(off) {
		s = int64(min(lo, uint64(limit)))
	}
	if hi < uint64(limit) {
		t = int64(max(hi, uint64(off)))
	}
	return s, t
}
