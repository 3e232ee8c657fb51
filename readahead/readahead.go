package readahead

import (
	"io"
	"math"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults used for the zero fields of [Options].
const (
	DefaultMinWindow  = 128 << 10
	DefaultMaxWindow  = 4 << 20
	DefaultMaxStreams = 8
	DefaultIdleTime   = 2 * time.Second
)

// runToStart is how many adjacent reads in a row start a stream.
const runToStart = 3

// adjacent is how close, in bytes, a read must start to the end of an
// earlier unbuffered read to start a stream: on either side, as compressed
// qcow2 clusters share a 512-byte sector with the next one (but a read of
// the same 4 KiB block again is not sequential). Kept small so that random
// reads rarely look sequential.
const adjacent = 4 << 10

// Options tune a [Reader]. Zero fields take the defaults.
type Options struct {
	// MinWindow is the size of a stream's first window in bytes
	// (default 128 KiB). A read within MinWindow/2 bytes of a stream
	// belongs to it.
	MinWindow int
	// MaxWindow is the largest window, in bytes, a stream grows to
	// (default 4 MiB; at least MinWindow). Reads longer than MaxWindow
	// bypass the buffers.
	MaxWindow int
	// MaxStreams is how many sequential streams are tracked at once
	// (default 8). Buffers in use never exceed MaxStreams*2*MaxWindow bytes.
	MaxStreams int
	// IdleTime is how long a stream may go unread before it is forgotten
	// and its buffers released (default 2s; negative: never).
	IdleTime time.Duration
}

func (o Options) withDefaults() Options {
	if o.MinWindow <= 0 {
		o.MinWindow = DefaultMinWindow
	}
	if o.MaxWindow <= 0 {
		o.MaxWindow = DefaultMaxWindow
	}
	o.MaxWindow = max(o.MaxWindow, o.MinWindow)
	if o.MaxStreams <= 0 {
		o.MaxStreams = DefaultMaxStreams
	}
	if o.IdleTime == 0 {
		o.IdleTime = DefaultIdleTime
	}
	return o
}

// A Reader is an [io.ReaderAt] that reads ahead of sequential streams of
// reads from another io.ReaderAt; see the package comment for how.
//
// mu guards closed, tick, streams, recent, next, timer, timerOn, the pool,
// and every stream's fields and the bookkeeping fields of every window
// (see [window]). The counters are atomic and read without mu. mu is never
// held during an underlying read or a copy to a caller.
type Reader struct {
	r    io.ReaderAt
	opts Options
	near int64 // a read within near bytes of a stream's span belongs to it

	// Counters for Stats.
	calls, reads, directReads, prefetches atomic.Int64
	readBytes, servedBytes, waits         atomic.Int64

	wg sync.WaitGroup // prefetch goroutines in flight; Add only under mu while !closed

	mu      sync.Mutex
	closed  bool
	tick    uint64      // counts calls; dates streams' last reads for replacement
	streams []*stream   // at most opts.MaxStreams
	recent  []candidate // runs of recent unbuffered reads, a ring
	next    int         // the ring slot recent overwrites next
	timer   *time.Timer // the idle sweep
	timerOn bool        // timer is armed
	pool    bufPool
}

// A candidate is a run of recent adjacent reads that belonged to no
// stream: where the last one ended, when (Reader.tick), and how many
// reads the run has had.
type candidate struct {
	end  int64
	tick uint64
	run  int
	ok   bool
}

// New returns a Reader reading from r. The Reader does not own r: Close
// does not close it.
func New(r io.ReaderAt, opts Options) *Reader {
	opts = opts.withDefaults()
	rd := &Reader{
		r:      r,
		opts:   opts,
		near:   int64(opts.MinWindow / 2),
		recent: make([]candidate, 4*opts.MaxStreams),
	}
	rd.pool.init(opts.MinWindow, opts.MaxWindow, int64(opts.MaxStreams)*2*int64(opts.MaxWindow))
	return rd
}

// ReadAt reads len(p) bytes at offset off, with the semantics of
// [io.ReaderAt]: n < len(p) only with an error, io.EOF at the end of the
// data (which may also come with n == len(p) when the underlying reader
// returns it so). It is safe to call from many goroutines at once.
func (r *Reader) ReadAt(p []byte, off int64) (int, error) {
	r.calls.Add(1)
	if len(p) == 0 || len(p) > r.opts.MaxWindow || off < 0 || off > math.MaxInt64-int64(len(p)) {
		return r.direct(p, off)
	}
	end := off + int64(len(p))

	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return r.direct(p, off)
	}
	r.tick++
	s := r.find(off, end)
	if s == nil {
		if s = r.promote(off, end); s == nil {
			r.mu.Unlock()
			return r.direct(p, off) // random: exactly the bytes asked for
		}
	}
	var pins [2]*window
	fetch := r.plan(s, off, end, &pins)
	r.mu.Unlock()

	if fetch != nil {
		r.fetch(fetch)
	}
	return r.copyOut(p, off, &pins)
}

// copyOut fills p (at off) from the pinned windows, which hold a prefix of
// the range in order, and unpins them. Whatever they do not hold, because
// a fetch failed or there was no window, is read directly, so the caller
// sees the underlying reader's own error for its own range.
func (r *Reader) copyOut(p []byte, off int64, pins *[2]*window) (int, error) {
	n := 0
	var err error
	more := true // the windows so far held every byte up to their end
	for _, w := range pins {
		if w == nil {
			break
		}
		if more && n < len(p) {
			select {
			case <-w.done:
			default:
				r.waits.Add(1)
				<-w.done
			}
			// After done, w.n and w.err are fixed and buf[:w.n] is filled.
			if start := off + int64(n) - w.off; start < int64(w.n) {
				n += copy(p[n:], w.buf[start:w.n])
			}
			switch {
			case n == len(p):
			case w.err == io.EOF:
				err, more = io.EOF, false
			case w.n < len(w.buf):
				more = false // failed: the rest is read directly below
			}
		}
		r.unref(w)
	}
	r.servedBytes.Add(int64(n))
	if n < len(p) && err == nil {
		m, derr := r.direct(p[n:], off+int64(n))
		return n + m, derr
	}
	return n, err
}

// direct passes a read straight to the underlying reader.
func (r *Reader) direct(p []byte, off int64) (int, error) {
	r.reads.Add(1)
	r.directReads.Add(1)
	n, err := r.r.ReadAt(p, off)
	r.readBytes.Add(int64(max(n, 0)))
	return n, err
}

// Close forgets every stream, waits for the prefetches in flight and
// releases the buffers. Reads after Close (or still running) work, but go
// straight to the underlying reader, which Close does not close. Close
// always returns nil.
func (r *Reader) Close() error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil
	}
	r.closed = true
	for _, s := range r.streams {
		r.dropAll(s)
	}
	r.streams = nil
	clear(r.recent)
	if r.timer != nil {
		r.timer.Stop()
	}
	r.pool.close()
	r.mu.Unlock()
	r.wg.Wait()
	return nil
}

// Stats are a Reader's counters since New. Calls and ServedBytes against
// Reads and ReadBytes tell how well reads were combined: for a compressed
// qcow2 image, Reads/Calls is the number of host reads per compressed
// cluster.
type Stats struct {
	Calls       int64 // ReadAt calls
	Reads       int64 // ReadAt calls on the underlying reader (window fetches and direct reads)
	DirectReads int64 // of Reads, those that passed a caller's read straight through
	Prefetches  int64 // of Reads, windows fetched ahead in the background
	ReadBytes   int64 // bytes returned by the underlying reader
	ServedBytes int64 // bytes copied to callers from windows
	Waits       int64 // reads that waited for a fetch in flight

	Streams         int   // streams tracked now
	BufferBytes     int64 // bytes of window buffers in use now
	PeakBufferBytes int64 // the most BufferBytes has been
	BufferLimit     int64 // the bound on BufferBytes: MaxStreams*2*MaxWindow
}

// Stats returns the Reader's counters. It is safe to call at any time.
func (r *Reader) Stats() Stats {
	r.mu.Lock()
	st := Stats{
		Streams:         len(r.streams),
		BufferBytes:     r.pool.inUse,
		PeakBufferBytes: r.pool.peak,
		BufferLimit:     r.pool.limit,
	}
	r.mu.Unlock()
	st.Calls = r.calls.Load()
	st.Reads = r.reads.Load()
	st.DirectReads = r.directReads.Load()
	st.Prefetches = r.prefetches.Load()
	st.ReadBytes = r.readBytes.Load()
	st.ServedBytes = r.servedBytes.Load()
	st.Waits = r.waits.Load()
	return st
}
