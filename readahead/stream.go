package readahead

import (
	"errors"
	"io"
	"slices"
	"sync/atomic"
	"time"
)

// errShort marks a fetch that returned fewer bytes than asked without an
// error, which io.ReaderAt forbids. Callers never see it: the bytes past
// the short fetch are read again directly.
var errShort = errors.New("readahead: short read without an error")

// A window is a buffer holding the bytes [off, off+len(buf)) of the
// underlying reader, filled by one ReadAt (its fetch).
//
// The buffer lives as long as someone holds a reference (refs): the stream
// listing the window, the fetch in flight, each ReadAt copying out of it.
// Whoever drops the last one returns the buffer to the pool. Only a holder
// of a reference may touch buf.
type window struct {
	off   int64
	buf   []byte
	bufp  *[]byte // buf's handle in the pool
	class int     // buf's size class in the pool

	// done is closed when the fetch is over. n and err are written (under
	// Reader.mu) before that and never change after, so a reader that has
	// received from done may read them, and buf[:n], without a lock.
	done chan struct{}
	n    int   // bytes fetched: buf[:n] holds data
	err  error // the fetch's error; io.EOF means the data ends at off+n

	refs atomic.Int32

	// Guarded by Reader.mu.
	s     *stream // the stream listing the window; nil once dropped
	ready bool    // done is closed (n and err may be read under mu)
	used  int64   // bytes served from the window, to tell a wasted one
}

func (w *window) end() int64 { return w.off + int64(len(w.buf)) }

// A stream is one sequential reader's position and windows.
// All its fields are guarded by Reader.mu.
type stream struct {
	win     []*window // at most 2, contiguous and in order: win[1].off == win[0].end()
	pos     int64     // the highest end of a read of the stream
	size    int       // the size class of its windows
	eof     int64     // where the data ends, once a fetch met it; -1 before
	used    uint64    // Reader.tick at the stream's last read
	gap     uint64    // the usual number of calls between its reads (a moving average)
	touched bool      // read since the last idle sweep
}

// span returns the range of offsets the stream is about: its windows, and
// the end of its last read.
func (s *stream) span() (lo, hi int64) {
	if n := len(s.win); n > 0 {
		return s.win[0].off, max(s.pos, s.win[n-1].end())
	}
	return s.pos, s.pos
}

// pastEOF reports whether off is at or past the known end of the data.
func (s *stream) pastEOF(off int64) bool { return s.eof >= 0 && off >= s.eof }

// find returns the stream the read [off, end) belongs to, or nil: a stream
// whose windows hold off if any, or else the most recently read stream
// whose span is within r.near bytes of the read. Called with mu held.
func (r *Reader) find(off, end int64) *stream {
	var best *stream
	for _, s := range r.streams {
		lo, hi := s.span()
		if off > hi+r.near || end < lo-r.near {
			continue
		}
		if n := len(s.win); n > 0 && off >= lo && off < s.win[n-1].end() {
			return s
		}
		if best == nil || s.used > best.used {
			best = s
		}
	}
	return best
}

// promote starts a stream for the read [off, end) if it is the third of a
// run of adjacent reads (see adjacent) and a stream slot can be had;
// otherwise it remembers the read as the end of its run and returns nil.
// Two random reads are adjacent now and then; three in a row hardly ever.
// Called with mu held.
func (r *Reader) promote(off, end int64) *stream {
	i := slices.IndexFunc(r.recent, func(c candidate) bool {
		return c.ok && off > c.end-adjacent && off <= c.end+adjacent
	})
	if i < 0 {
		r.recent[r.next] = candidate{end: end, tick: r.tick, run: 1, ok: true}
		r.next = (r.next + 1) % len(r.recent)
		return nil
	}
	c := &r.recent[i]
	if c.run+1 >= runToStart {
		if s := r.newStream(end, r.tick-c.tick); s != nil {
			*c = candidate{}
			return s
		}
	}
	c.end, c.tick, c.run = end, r.tick, min(c.run+1, runToStart)
	return nil
}

// newStream adds a stream whose last read ended at end, gap calls after
// the one before. If all slots are taken, it replaces the least recently
// read stream, but only if that one is stale; otherwise more streams are
// active than there are slots, and newStream returns nil: the new stream
// stays unbuffered, rather than have streams take each other's slots in
// turn, each fetching a window for a read or two. Called with mu held.
func (r *Reader) newStream(end int64, gap uint64) *stream {
	if len(r.streams) == r.opts.MaxStreams {
		lru := 0
		for i, s := range r.streams {
			if s.used < r.streams[lru].used {
				lru = i
			}
		}
		if !r.stale(r.streams[lru]) {
			return nil
		}
		r.dropAll(r.streams[lru])
		r.streams = slices.Delete(r.streams, lru, lru+1)
	}
	s := &stream{win: make([]*window, 0, 2), pos: end, eof: -1, used: r.tick, gap: gap}
	r.streams = append(r.streams, s)
	if r.opts.IdleTime > 0 && !r.timerOn {
		r.timerOn = true
		if r.timer == nil {
			r.timer = time.AfterFunc(r.opts.IdleTime, r.sweep)
		} else {
			r.timer.Reset(r.opts.IdleTime)
		}
	}
	return s
}

// plan decides how the read [off, end) of stream s is served. It pins into
// pins the windows holding a prefix of the read (copyOut reads the rest
// directly), and returns a new window the caller must fetch itself when the
// read needs one now. Called with mu held.
//
// A stream moves on by how much of its last window has been read (used),
// not by where reads land: reads of parallel workers arrive in any order,
// but once half of the last window has been served, the stream is consuming
// it, and the next window is prefetched. Random reads that happen to fall
// on or near a stream's windows add too few bytes to move it on, and a read
// only counts for the stream (its position, its age) if its windows serve
// it.
func (r *Reader) plan(s *stream, off, end int64, pins *[2]*window) (fetch *window) {
	switch n := len(s.win); {
	case s.pastEOF(off) && (n == 0 || off >= s.win[n-1].end()):
		return nil // nothing there to fetch; read directly, it says io.EOF
	case n == 0:
		// A new stream, or one whose windows failed or were reclaimed.
		fetch = r.addWindow(s, off, end-off)
	case off >= s.win[n-1].end():
		// Past the windows, but near: reads of parallel workers running
		// ahead of a window still being read, or a prefetch that did not
		// start in time. Follow them with a window contiguous with the
		// last, if the stream is consuming that one.
		if last := s.win[n-1]; off-last.end() <= r.near && r.active(last) {
			fetch = r.addWindow(s, last.end(), end-last.end())
		}
	}

	// Pin the windows holding the read, which must start in the first of
	// them: a read behind the windows (a worker that lost a race to its
	// neighbours by more than a window) is read directly, so that the
	// windows stay where the stream is going.
	n := 0
	if len(s.win) > 0 && off >= s.win[0].off {
		for _, w := range s.win {
			if w.off < end && off < w.end() {
				w.refs.Add(1)
				w.used += min(end, w.end()) - max(off, w.off)
				pins[n] = w
				n++
			}
		}
	}
	if n == 0 {
		return nil
	}
	s.gap = (3*s.gap + (r.tick - s.used)) / 4
	s.used, s.touched = r.tick, true
	s.pos = max(s.pos, end)

	last := s.win[len(s.win)-1]
	if fetch == nil && end > last.end() && off >= last.off && r.active(last) && !s.pastEOF(last.end()) {
		// The read runs off the end of the window the stream is
		// consuming: the prefetch did not start in time. Fetch the next
		// window now, contiguous with the last so that nothing is read
		// twice, and take the rest of the read from it. (The read starts
		// in last, so it pinned only last: pins has room. A read from
		// the first window past the last gets the rest directly.)
		if fetch = r.addWindow(s, last.end(), end-last.end()); fetch != nil {
			fetch.refs.Add(1)
			fetch.used += end - fetch.off
			pins[n] = fetch
			last = fetch
		}
	}
	if last.used >= int64(len(last.buf)/2) && !s.pastEOF(last.end()) {
		// Each prefetched window is twice the one before: the stream has
		// shown it reads its windows. Windows fetched for a read keep the
		// size, so a stream grows only as fast as it is consumed.
		s.size = min(s.size+1, len(r.pool.sizes)-1)
		if w := r.addWindow(s, last.end(), 0); w != nil {
			r.prefetch(w)
		}
	}
	return fetch
}

// active reports whether the stream is consuming its last window w: w is
// still being fetched (for the read that started the stream, or ahead of
// it), or a quarter of it has been read. Called with mu held.
func (r *Reader) active(w *window) bool {
	return !w.ready || w.used >= int64(len(w.buf)/4)
}

// stale reports whether stream s may give up its slot or its buffers to
// another stream: it has gone unread for more than twice its usual gap
// between reads (plus 2*MaxStreams calls), or it is only read now and then
// (its usual gap exceeds 8*MaxStreams calls; say, random reads landing on
// the windows of a finished scan). A stream merely waiting its turn among
// more interleaved streams than there are slots is not stale. Called with
// mu held.
func (r *Reader) stale(s *stream) bool {
	k := uint64(r.opts.MaxStreams)
	return s.gap > 8*k || r.tick-s.used > 2*s.gap+2*k
}

// addWindow appends to s a window at off, of the stream's size or large
// enough for need bytes, dropping the stream's older window if it
// has two. If the buffer would take the bytes in use past the bound, it
// first takes the windows of stale streams, least recently read first. It
// returns nil, adding nothing, if need is larger than MaxWindow or there is
// no room. The window starts with two references: the stream's and its
// fetch's. Called with mu held.
func (r *Reader) addWindow(s *stream, off int64, need int64) *window {
	c := s.size
	if need > int64(r.pool.sizes[c]) {
		if c = r.pool.class(need); c < 0 {
			return nil
		}
	}
	if len(s.win) == 2 {
		r.drop(s, 0)
	}
	bp := r.pool.get(c)
	for bp == nil {
		var victim *stream
		for _, v := range r.streams {
			if v != s && len(v.win) > 0 && r.stale(v) && (victim == nil || v.used < victim.used) {
				victim = v
			}
		}
		if victim == nil {
			return nil
		}
		r.dropAll(victim)
		bp = r.pool.get(c)
	}
	w := &window{off: off, buf: *bp, bufp: bp, class: c, s: s, done: make(chan struct{})}
	w.refs.Store(2)
	s.win = append(s.win, w)
	s.size = c
	return w
}

// prefetch fetches w in a new goroutine. Called with mu held, !r.closed.
func (r *Reader) prefetch(w *window) {
	r.prefetches.Add(1)
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		r.fetch(w)
	}()
}

// fetch fills w with one underlying read, publishes the result and drops
// the fetch's reference. A failed window leaves its stream, so that a later
// read fetches again; one that met the end of the data tells its stream
// where the data ends. Called without mu.
func (r *Reader) fetch(w *window) {
	r.reads.Add(1)
	n, err := r.r.ReadAt(w.buf, w.off)
	n = max(0, min(n, len(w.buf)))
	r.readBytes.Add(int64(n))
	if n < len(w.buf) && err == nil {
		err = errShort
	}

	r.mu.Lock()
	w.n, w.err, w.ready = n, err, true
	if s := w.s; s != nil {
		switch {
		case err == io.EOF:
			if end := w.off + int64(n); s.eof < 0 || end < s.eof {
				s.eof = end
			}
		case err != nil:
			r.drop(s, slices.Index(s.win, w))
		}
	}
	r.mu.Unlock()
	close(w.done)
	r.unref(w)
}

// drop removes s.win[i] from the stream. A window dropped with less than
// half of it read was too large for how the stream is read: the next window
// will be half its size. Called with mu held.
func (r *Reader) drop(s *stream, i int) {
	w := s.win[i]
	if w.used < int64(len(w.buf))/2 {
		s.size = min(s.size, max(w.class-1, 0))
	}
	s.win = slices.Delete(s.win, i, i+1)
	w.s = nil
	r.unrefLocked(w)
}

// dropAll releases every window of s (a stream being forgotten).
// Called with mu held.
func (r *Reader) dropAll(s *stream) {
	for _, w := range s.win {
		w.s = nil
		r.unrefLocked(w)
	}
	s.win = s.win[:0]
}

// unref drops a reference to w, returning its buffer to the pool if it was
// the last. Called without mu.
func (r *Reader) unref(w *window) {
	if w.refs.Add(-1) == 0 {
		// Nobody else can reach w any more: only a stream hands out
		// references, and w has left its stream.
		r.mu.Lock()
		r.pool.put(w.class, w.bufp)
		r.mu.Unlock()
	}
}

// unrefLocked is unref with mu held.
func (r *Reader) unrefLocked(w *window) {
	if w.refs.Add(-1) == 0 {
		r.pool.put(w.class, w.bufp)
	}
}

// sweep runs every IdleTime while there are streams: it forgets the streams
// not read since the last sweep, releasing their buffers.
func (r *Reader) sweep() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return
	}
	kept := r.streams[:0]
	for _, s := range r.streams {
		if s.touched {
			s.touched = false
			kept = append(kept, s)
		} else {
			r.dropAll(s)
		}
	}
	clear(r.streams[len(kept):])
	r.streams = kept
	if len(r.streams) > 0 {
		r.timer.Reset(r.opts.IdleTime)
	} else {
		r.timerOn = false
	}
}
