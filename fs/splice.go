package fs

import (
	"fmt"
	"math/bits"

	"github.com/hanwen/go-fuse/v2/fuse"
	"github.com/hanwen/go-fuse/v2/splice"

	"github.com/qcowfs/qcowfs/qcow2"
)

// Zero-copy replies that cannot end a file early.
//
// A fuse.ReadResultFd is spliced by go-fuse straight from the host file
// into its pipe; when that splice comes up short (the host file shrank
// since the image was opened) go-fuse sends the shorter reply it got, and
// the kernel takes a short read for the end of the file: a reader copying
// the disk would stop early without an error. So the host range is spliced
// into a pipe of our own first, where the count is checked: a short splice
// is an error (EIO to the reader, as the copying path gives), and go-fuse
// then moves the pipe's pages into its reply. The pages are not copied
// either way; the price is one more splice, pipe to pipe.

// replyHeader is the FUSE reply header go-fuse puts before the payload in
// its pipe.
const replyHeader = 16

// spliceOne answers a read of size bytes from host offset hoff of file
// fd, or returns nil (and no error) when the reply would not fit in
// go-fuse's pipe, so the caller copies instead.
func spliceOne(fd uintptr, hoff int64, size int) (fuse.ReadResult, error) {
	// Pipe slots are pages: the host range takes one per page it
	// touches, the header one more. go-fuse sizes its pipe for the
	// reply plus one page, rounded up to a power of two pages by the
	// kernel; an unaligned range can need one slot more than that.
	pages := (int(hoff%pageSize) + size + pageSize - 1) / pageSize
	if 1+pages > pipePages(replyHeader+size+pageSize) {
		return nil, nil
	}
	pair, err := splice.Get()
	if err != nil {
		return nil, nil
	}
	if err := pair.Grow(size + pageSize); err != nil {
		splice.Drop(pair)
		return nil, nil
	}
	if err := loadFromAt(pair, fd, size, hoff); err != nil {
		splice.Drop(pair)
		return nil, err
	}
	return fuse.ReadResultPipe(pair, size), nil
}

// pipePages is how many page slots a pipe grown to n bytes has: the
// kernel rounds its size up to a power of two pages.
func pipePages(n int) int {
	p := (n + pageSize - 1) / pageSize
	return 1 << bits.Len(uint(p-1))
}

// errShortSplice reports a splice that got fewer bytes than the host file
// held when the image was opened.
func errShortSplice(fd uintptr, off int64, got, want int) error {
	return fmt.Errorf("splicing %d bytes at byte offset %d of host file descriptor %d: got %d: %w", want, off, fd, got, qcow2.ErrShortRead)
}
