package remote

import "sync"

// readahead finds sequential readers of an Object and tells how far ahead
// of each to prefetch.
//
// It tracks up to maxStreams streams, each the end of a run of reads and a
// window. A read that starts up to one chunk before a stream's end or half
// a chunk after it (parallel FUSE readers arrive slightly out of order)
// belongs to that stream, and continues it if it ends past the stream's
// end; any other read starts a new stream in place of the least recently
// used one, and prefetches nothing. Prefetching starts at a stream's
// second continuation: one random read may land near another, two in a
// row hardly ever, and a reader re-reading one spot never continues its
// stream. So a random reader costs only the chunks it reads, and a
// sequential one gets, from its third read on, a window of prefetched
// chunks ahead of it that starts at one chunk and doubles each time the
// reader has used a step of it, up to MaxReadahead. A step is half the
// window, and at most MaxRequest: each prefetch is then one or a few large
// range requests rather than one small request per chunk, and a reader as
// fast as the link keeps the whole window in flight, a request started
// each time one is used, rather than waiting at every half window for
// that half to arrive at once. The chunks a stream has read through,
// every byte (wholly within its latest run of reads without a gap, and
// before the chunk of its latest read), are released from the cache
// (cache.release): a scan does not come back, and its slots are then the
// ones it reuses. A chunk it skipped part of is left: another reader may
// want that part.
//
// mu guards the streams; it is held for this bookkeeping only.
type readahead struct {
	mu      sync.Mutex
	streams [maxStreams]stream
	tick    uint64
}

const maxStreams = 4

type stream struct {
	next   int64  // where the stream's reads have got to (bytes)
	ahead  int64  // chunks before this index are read or prefetched
	behind int64  // chunks before this index are released, or not the stream's to release
	run    int64  // where the stream's latest run of reads without a gap began (bytes)
	win    int64  // the window, in chunks; 0 until prefetching starts
	hits   int    // reads that continued the stream
	used   uint64 // readahead.tick at the last read; 0: slot unused
}

// advise records a read of [off, end) of o and returns the chunks to
// prefetch, [from, to), and the chunks the stream has read through, to
// release once this read is done, [past, pastEnd); either may be empty.
func (r *readahead) advise(off, end int64, o *Object) (from, to, past, pastEnd int64) {
	cs := o.c.opts.ChunkSize
	maxWin := o.c.opts.MaxReadahead / cs
	if maxWin == 0 {
		return 0, 0, 0, 0
	}
	firstChunk, lastChunk := off/cs, (end-1)/cs
	r.mu.Lock()
	defer r.mu.Unlock()
	r.tick++
	var st *stream
	for i := range r.streams {
		s := &r.streams[i]
		if s.used != 0 && off >= s.next-cs && off <= s.next+cs/2 {
			st = s
			break
		}
	}
	if st == nil {
		lru := &r.streams[0]
		for i := range r.streams {
			if r.streams[i].used < lru.used {
				lru = &r.streams[i]
			}
		}
		*lru = stream{next: end, ahead: lastChunk + 1, behind: firstChunk, run: off, used: r.tick}
		return 0, 0, 0, 0
	}
	st.used = r.tick
	if end <= st.next {
		return 0, 0, 0, 0 // behind the stream's end: nothing new about it
	}
	if off > st.next {
		st.run = off // a gap: what it skipped may be read by someone else
	}
	st.next = end
	if from := max(st.behind, (st.run+cs-1)/cs); firstChunk > from {
		past, pastEnd = from, firstChunk
		st.behind = firstChunk
	}
	if st.hits++; st.hits < 2 {
		st.ahead = max(st.ahead, lastChunk+1)
		return 0, 0, past, pastEnd
	}
	// The step: half the window, and at most one request's worth once
	// the window is larger, so that a fast reader keeps the window's
	// requests in flight one after another instead of waiting, at every
	// half window, for half of it to arrive together.
	step := max(1, min(st.win/2, o.c.opts.MaxRequest/cs))
	if st.win == 0 {
		st.win = 1
		st.ahead = max(st.ahead, lastChunk+1)
	} else if st.ahead-(lastChunk+1) > st.win-step {
		return 0, 0, past, pastEnd // less than a step of the window used
	} else {
		st.win = min(2*st.win, maxWin)
	}
	from = max(st.ahead, lastChunk+1)
	to = min(lastChunk+1+st.win, o.nchunks)
	if from >= to {
		return 0, 0, past, pastEnd
	}
	st.ahead = to
	return from, to, past, pastEnd
}
