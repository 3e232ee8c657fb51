package fs

import (
	"io"
	"sync"
	"syscall"

	"github.com/hanwen/go-fuse/v2/fuse"
	"github.com/hanwen/go-fuse/v2/splice"

	"github.com/qcowfs/qcowfs/qcow2"
)

// ReadPath selects how image reads are answered.
type ReadPath int

const (
	// ReadSplice answers reads of spliceMin bytes or more whose bytes are
	// stored uncompressed (or are zeros) without copying them through our
	// memory: one host range is a fuse.ReadResultFd, several ranges and
	// zero runs are spliced into a pipe. Smaller reads, and reads
	// touching compressed or encrypted clusters, are copied. The default.
	ReadSplice ReadPath = iota
	// ReadCopy reads every request into the request buffer (one copy in,
	// one copy out to the kernel). Kept as the fallback, and to measure
	// against.
	ReadCopy
)

// maxSpliceExtents bounds the extents one spliced reply may gather; a
// request more fragmented than that is copied instead.
const maxSpliceExtents = 32

// spliceMin is the smallest read answered by splicing. A splice costs
// five system calls and two pipes (ours and go-fuse's: file to pipe, the
// header into go-fuse's, pipe to pipe, pipe to /dev/fuse), a copy two
// (pread into the request's buffer, writev to /dev/fuse) and two copies of
// the bytes; below this size the calls cost more than the bytes (a 4 KiB
// random read spent three quarters of its daemon CPU in splice calls).
const spliceMin = 64 << 10

// zeros is a shared source of zero bytes for replies, never written.
var zeros = make([]byte, 1<<20)

// read answers a read of the image: at most len(dest) bytes at off, and
// nothing at or past limit (the end of the disk, or of a partition).
func (m *mount) read(oi *openImage, dest []byte, off, limit int64) (fuse.ReadResult, syscall.Errno) {
	return m.readImage(oi, oi.image(), dest, off, limit)
}

// readImage is read from img, one of oi's images (the original file's, for
// a bitmap's view: bitmaps.go).
func (m *mount) readImage(oi *openImage, img *qcow2.Image, dest []byte, off, limit int64) (fuse.ReadResult, syscall.Errno) {
	limit = min(limit, img.Size())
	if off >= limit {
		return fuse.ReadResultData(nil), 0
	}
	size := min(int64(len(dest)), limit-off)
	// The pin lasts until the reply has gone to the kernel (Done):
	// go-fuse splices after Read returns, and a host cluster freed and
	// written again meanwhile must not reach this reply, nor an in-place
	// write tear one of its sectors.
	pin := img.PinRange(off, size)
	if m.cfg.ReadPath == ReadSplice && size >= spliceMin {
		rr, err := spliceRead(img, off, size)
		if err != nil {
			pin.Release()
			return nil, m.readFailed(oi, off, err)
		}
		if rr != nil {
			oi.countRead(size)
			return pinned(rr, pin), 0
		}
	}
	n, err := img.ReadAt(dest[:size], off)
	pin.Release()
	if err != nil && err != io.EOF {
		return nil, m.readFailed(oi, off, err)
	}
	oi.countRead(int64(n))
	return sliceResult(dest[:n]), 0
}

// bytesResult is a reply of bytes in memory that go-fuse writes with one
// writev: a fuse.ReadResultData is first tried as a splice (a pipe taken,
// the header written into it, then drained to /dev/null and the pipe's
// emptiness checked: four wasted system calls per reply) because it lacks
// the Slices method that sends a reply straight.
type bytesResult struct{ b [1][]byte }

var bytesResults = sync.Pool{New: func() any { return new(bytesResult) }}

// sliceResult returns a reply of b, which must stay valid until it is sent
// (the request's buffer does).
func sliceResult(b []byte) fuse.ReadResult {
	r := bytesResults.Get().(*bytesResult)
	r.b[0] = b
	return r
}

func (r *bytesResult) Size() int                          { return len(r.b[0]) }
func (r *bytesResult) Bytes([]byte) ([]byte, fuse.Status) { return r.b[0], fuse.OK }
func (r *bytesResult) Slices() ([][]byte, fuse.Status)    { return r.b[:], fuse.OK }
func (r *bytesResult) Done()                              { r.b[0] = nil; bytesResults.Put(r) }

// countRead counts a read answered with n bytes.
func (oi *openImage) countRead(n int64) {
	oi.readRequests.Add(1)
	oi.readBytes.Add(n)
}

// pinned returns rr with its Done releasing pin too. Splicing replies are
// recognised by go-fuse by their methods (Seekable for one host range,
// Stateful for a pipe), so the wrapper has the same.
func pinned(rr fuse.ReadResult, pin qcow2.Pin) fuse.ReadResult {
	switch r := rr.(type) {
	case interface {
		Seekable() (uintptr, int64, int)
	}:
		fd, off, sz := r.Seekable()
		return &pinnedFd{ReadResult: rr, fd: fd, off: off, sz: sz, pin: pin}
	case interface {
		Stateful() (uintptr, int)
		SpliceFlags() int
	}:
		return &pinnedPipe{ReadResult: rr, pin: pin}
	default:
		// Bytes in memory (zeros): nothing to keep.
		pin.Release()
		return rr
	}
}

// pinnedFd is a reply spliced from one host range.
type pinnedFd struct {
	fuse.ReadResult
	fd  uintptr
	off int64
	sz  int
	pin qcow2.Pin
}

func (r *pinnedFd) Seekable() (uintptr, int64, int) { return r.fd, r.off, r.sz }
func (r *pinnedFd) Done()                           { r.ReadResult.Done(); r.pin.Release() }

// pinnedPipe is a reply gathered in a pipe.
type pinnedPipe struct {
	fuse.ReadResult
	pin qcow2.Pin
}

func (r *pinnedPipe) Stateful() (uintptr, int) {
	return r.ReadResult.(interface{ Stateful() (uintptr, int) }).Stateful()
}
func (r *pinnedPipe) SpliceFlags() int {
	return r.ReadResult.(interface{ SpliceFlags() int }).SpliceFlags()
}
func (r *pinnedPipe) Done() { r.ReadResult.Done(); r.pin.Release() }

// spliceRead answers [off, off+size) without copying when every extent of
// it is stored as is in a host file or reads as zeros. It returns nil (and
// no error) when the range needs copying.
func spliceRead(img *qcow2.Image, off, size int64) (fuse.ReadResult, error) {
	var buf [maxSpliceExtents]qcow2.Extent
	exts := buf[:0]
	hosts := 0
	aligned := true
	for pos, end := off, off+size; pos < end; {
		e, err := img.Extent(pos, end-pos)
		if err != nil {
			return nil, err
		}
		if _, hoff, ok := e.Host(); ok {
			hosts++
			aligned = aligned && hoff%pageSize == 0
		} else if e.Status&qcow2.StatusData != 0 || len(exts) == maxSpliceExtents {
			return nil, nil
		}
		aligned = aligned && e.Start%pageSize == 0 && (e.Length%pageSize == 0 || pos+e.Length == end)
		exts = append(exts, e)
		pos += e.Length
	}
	switch {
	case len(exts) == 1 && hosts == 1:
		// Through a pipe of our own, which counts (splice.go).
		f, hoff, _ := exts[0].Host()
		return spliceOne(f, hoff, int(size))
	case hosts == 0 && size <= int64(len(zeros)):
		return sliceResult(zeros[:size]), nil
	}
	if !aligned {
		// Every splice into a pipe takes at least one of its slots (a
		// page each), and a pipe sized for the reply has just enough
		// slots for whole pages: sub-page pieces (512-byte clusters,
		// unaligned host offsets) would overflow it, and go-fuse would
		// send a short reply, which the kernel takes for end of file.
		return nil, nil
	}
	return pipeRead(exts, int(size))
}

const pageSize = 4096

// pipeRead gathers several host ranges and zero runs into a pipe, which
// go-fuse splices into the FUSE device. It returns nil if the pipe cannot
// hold the reply (an unprivileged process cannot grow pipes past
// /proc/sys/fs/pipe-max-size), so the caller copies instead.
func pipeRead(exts []qcow2.Extent, size int) (fuse.ReadResult, error) {
	pair, err := splice.Get()
	if err != nil {
		return nil, nil
	}
	if err := pair.Grow(size); err != nil {
		splice.Drop(pair)
		return nil, nil
	}
	for i := range exts {
		e := &exts[i]
		var err error
		if f, hoff, ok := e.Host(); ok {
			err = loadFromAt(pair, f, int(e.Length), hoff)
		} else {
			err = writeAll(pair, zeros, int(e.Length))
		}
		if err != nil {
			splice.Drop(pair)
			return nil, err
		}
	}
	return fuse.ReadResultPipe(pair, size), nil
}

// loadFromAt splices n bytes at off of fd into the pipe, looping over
// short splices; the end of the file before n bytes is an error
// (splice.go).
func loadFromAt(p *splice.Pair, fd uintptr, n int, off int64) error {
	for want, start, got := n, off, 0; n > 0; {
		k, err := p.LoadFromAt(fd, n, off)
		if err != nil {
			return err
		}
		if k == 0 {
			return errShortSplice(fd, start, got, want)
		}
		n -= k
		got += k
		off += int64(k)
	}
	return nil
}

// writeAll writes n bytes of src (repeated as needed) into the pipe.
func writeAll(p *splice.Pair, src []byte, n int) error {
	for n > 0 {
		k, err := p.Write(src[:min(n, len(src))])
		if err != nil {
			return err
		}
		n -= k
	}
	return nil
}
