package fs

import (
	"sync"
)

// Re-reads of a page cache with holes in it.
//
// Image files are opened with FOPEN_KEEP_CACHE: a second read of a disk
// is served from the kernel's page cache. But the kernel may evict the
// cached pages of a file unevenly: proactive reclaim (DAMON's paddr
// pageout, which this kind of VM runs: pages unused for a minute go, a
// physical region at a time) and memory pressure leave every few pages
// missing. A sequential reader then gets the pages that stayed from the
// cache and the kernel asks the daemon for each hole alone, a page or two
// at a time: readahead stops at the first cached page. A re-read of
// 2 GiB came to the daemon as 4 KiB requests, at 2 CPU seconds per GiB
// and 0.6x the rate of the cold read that filled the cache (issue 45).
//
// So the daemon watches for it: a handle that gets holeRun small reads in
// a row, each starting at most holeGap past where the one before ended (a
// sequential reader meeting holes, the cached pages between them skipped:
// with an empty cache the kernel's readahead asks in requests of up to
// max_read), has the rest of the file's cached pages
// dropped once (an inode notification), from the end of that read on:
// from there readahead meets no cached page, and the reader gets requests
// of max_read again. What is dropped is read again from the image, in
// large requests. A reader that keeps making small reads (O_DIRECT, or a
// program reading a page at a time from an empty cache, whose readahead
// the kernel makes large anyway) costs one notification per holeSpan of
// the file.

const (
	holeSmall = 32 << 10 // a read this small or smaller is small
	holeRun   = 8        // small forward reads in a row that start a drop
	holeGap   = 1 << 20  // how far past the last read's end the next may start
	holeSpan  = 64 << 20 // at most one drop per this much of the file read
)

// holeWatch is one handle's view of its reads, for the above.
type holeWatch struct {
	mu        sync.Mutex
	next      int64 // where the last read ended
	run       int   // small reads in a row, each at next
	droppedAt int64 // the file offset of the last drop, -1 before any
}

func newHoleWatch() *holeWatch { return &holeWatch{droppedAt: -holeSpan} }

// read notes a read of n bytes at off (file offsets) and reports whether
// the file's cached pages from off+n on should be dropped now.
func (h *holeWatch) read(off, n int64) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	sequential := off >= h.next && off-h.next <= holeGap
	h.next = off + n
	if n > holeSmall || !sequential {
		h.run = 0
		return false
	}
	h.run++
	if h.run < holeRun || off-h.droppedAt < holeSpan && off >= h.droppedAt {
		return false
	}
	h.run, h.droppedAt = 0, off
	return true
}
