package remote

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
)

// An Object is one remote object, open for reading at the version first
// seen. It is an io.ReaderAt, safe for concurrent use.
//
// Reads go through the Client's chunk cache. The chunks a read needs that
// are missing are fetched at once: adjacent ones in one range request (up
// to MaxRequest), the others in parallel, up to Connections requests in
// flight per Client. A chunk being fetched is fetched once; other readers
// wait for it. Sequential reads also start prefetches (see readahead.go).
type Object struct {
	c       *Client
	be      backend
	url     string // redacted
	meta    meta
	nchunks int64
	id      uint64 // cache id, shared by Objects of the same version
	ident   string // the key of id in Client.ids
	diskKey string // disk cache folder, "" without a disk cache
	st      counters
	ra      readahead

	// ctx ends with Close: prefetches and fetches started by reads of this
	// Object stop then. wg counts the goroutines fetching for it.
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu           sync.Mutex            // orders wg.Add against Close's wg.Wait
	closed       atomic.Bool           // set under mu
	changed      atomic.Pointer[error] // the first ErrChanged seen
	offlineNoted atomic.Bool           // a read refused offline was logged
	lastFail     atomic.Pointer[error] // the last failed attempt of a fetch, for timeout errors
	closeOnce    sync.Once

	health health // whether the server answers (health.go)
}

// Size returns the object's size in bytes.
func (o *Object) Size() int64 { return o.meta.size }

// URL returns the object's URL, redacted (see Redact).
func (o *Object) URL() string { return o.url }

// Version returns what reads are pinned to: the S3 version id in a
// versioned bucket, else the ETag, else the Last-Modified time.
func (o *Object) Version() string { return o.meta.version() }

// ETag returns the ETag the object was opened at, quotes included ("" if
// the server sent none): what a listing's Entry.ETag says of the same
// version.
func (o *Object) ETag() string { return o.meta.etag }

// Stats returns the Object's counters.
func (o *Object) Stats() Stats { return o.st.load() }

// Close ends the Object's fetches and frees its cached chunks (unless
// another Object of the same version is open). Reads after Close fail with
// ErrClosed.
func (o *Object) Close() error {
	o.closeOnce.Do(func() {
		o.mu.Lock()
		o.closed.Store(true)
		o.mu.Unlock()
		o.cancel()
		o.wg.Wait()
		o.c.forget(o)
	})
	return nil
}

// ReadAt reads len(p) bytes at off, as io.ReaderAt: fewer only at the end
// of the object, with io.EOF. It fails rather than hang: within
// Options.Timeout it returns the bytes or an *Error (wrapping ErrTimeout,
// ErrChanged, ErrNoRange, ErrAuth, ...). It never returns bytes of two
// versions: once the object is seen to have changed, every read fails
// with ErrChanged.
func (o *Object) ReadAt(p []byte, off int64) (int, error) {
	return o.ReadAtContext(context.Background(), p, off)
}

// ReadAtContext is ReadAt ending early, with ctx's error, if ctx does.
func (o *Object) ReadAtContext(ctx context.Context, p []byte, off int64) (int, error) {
	if o.closed.Load() {
		return 0, o.fail(off, len(p), ErrClosed)
	}
	if e := o.changed.Load(); e != nil {
		return 0, o.fail(off, len(p), *e)
	}
	if off < 0 {
		return 0, o.fail(off, len(p), errors.New("negative offset"))
	}
	if off >= o.meta.size {
		if len(p) == 0 {
			return 0, nil
		}
		return 0, io.EOF
	}
	want := p
	if rest := o.meta.size - off; int64(len(p)) > rest {
		want = p[:rest]
	}
	if len(want) == 0 {
		return 0, nil
	}
	end := off + int64(len(want))
	from, to, past, pastEnd := o.ra.advise(off, end, o)
	if from < to {
		o.prefetch(from, to)
	}
	if err := o.read(ctx, want, off); err != nil {
		o.c.count(&o.st, func(k *counters) { k.errors.Add(1) })
		switch {
		case errors.Is(err, ErrChanged):
			o.setChanged(err)
		case errors.Is(err, ErrOffline):
			o.noteOffline(off, err)
		case errors.Is(err, ErrTimeout) && ctx.Err() == nil:
			o.markDown(err)
		}
		return 0, o.fail(off, len(p), err)
	}
	if past < pastEnd {
		o.c.cache.release(o.id, past, pastEnd)
	}
	if len(want) < len(p) {
		return len(want), io.EOF
	}
	return len(want), nil
}

func (o *Object) fail(off int64, n int, err error) error {
	return &Error{Op: "read", URL: o.url, Off: off, Len: int64(n), Err: err}
}

// setChanged records the first ErrChanged, and logs it once.
func (o *Object) setChanged(err error) {
	if o.changed.CompareAndSwap(nil, &err) {
		o.c.opts.Log.Error("remote: object changed while open; its reads fail from now on",
			"url", o.url, "version", o.meta.version(), "err", err)
	}
}

func (o *Object) key(idx int64) chunkKey { return chunkKey{o.id, idx} }

// chunkLen is the length of chunk idx (the last may be short).
func (o *Object) chunkLen(idx int64) int {
	cs := o.c.opts.ChunkSize
	return int(min(cs, o.meta.size-idx*cs))
}

// copyOut copies the part of chunk idx (in buf) that [off, off+len(p))
// covers into p.
func (o *Object) copyOut(p []byte, off, idx int64, buf []byte) {
	cs := o.c.opts.ChunkSize
	start := idx * cs
	lo, hi := max(off, start), min(off+int64(len(p)), start+int64(len(buf)))
	copy(p[lo-off:hi-off], buf[lo-start:hi-start])
}

// pending is a chunk a read waits for.
type pending struct {
	idx int64
	s   *slot
}

// read fills p with the bytes at off, all within the object. The common
// case, every chunk in the cache, allocates nothing: the read's Timeout
// starts only when a chunk is missing.
func (o *Object) read(ctx context.Context, p []byte, off int64) error {
	cs := o.c.opts.ChunkSize
	first, last := off/cs, (off+int64(len(p))-1)/cs
	for idx := first; idx <= last; idx++ {
		s, r := o.c.cache.get(o.key(idx))
		if r != hit {
			ctx, cancel := context.WithTimeout(ctx, o.c.opts.Timeout)
			defer cancel()
			return o.readSlow(ctx, p, off, idx, last, s, r)
		}
		o.copyOut(p, off, idx, s.buf[:s.n])
		s.unpin()
		o.st.hits.Add(1)
		o.c.st.hits.Add(1)
	}
	return nil
}

// readSlow reads chunks idx..last, starting with the cache's answer (s, r)
// for chunk idx. Missing chunks are reserved, read from the disk cache or
// fetched, in runs of adjacent chunks, each run in its own goroutine; then
// the read waits for every chunk it needs. A chunk whose fetch failed in a
// way worth retrying (a fetch by another reader that timed out or was
// dropped) goes round again while ctx lasts.
func (o *Object) readSlow(ctx context.Context, p []byte, off, idx, last int64, s *slot, r getResult) error {
	maxRun := int(o.c.opts.MaxRequest / o.c.opts.ChunkSize)
	todo := make([]int64, 0, last-idx+1)
	for i := idx; i <= last; i++ {
		todo = append(todo, i)
	}
	var (
		waits   []pending
		run     []*slot
		lastErr error
	)
	flush := func() {
		if len(run) > 0 {
			o.startRun(run, false)
			run = nil
		}
	}
	down := o.woken()
	timedOut := func() error {
		if lastErr == nil {
			if e := o.lastFail.Load(); e != nil {
				lastErr = *e // what the fetches this read waits for ran into
			}
		}
		return o.c.expired(ctx, ctx.Err(), lastErr)
	}
	for round := 0; len(todo) > 0; round++ {
		if ctx.Err() != nil {
			return timedOut()
		}
		if o.closed.Load() {
			return ErrClosed // its fetches are dropped: do not start more
		}
		waits = waits[:0]
		for _, i := range todo {
			if round > 0 || i != idx {
				s, r = o.c.cache.get(o.key(i))
			}
			switch r {
			case hit:
				flush()
				o.copyOut(p, off, i, s.buf[:s.n])
				s.unpin()
				o.c.count(&o.st, func(k *counters) { k.hits.Add(1) })
			case wait:
				flush()
				waits = append(waits, pending{i, s})
				o.c.count(&o.st, func(k *counters) { k.misses.Add(1); k.waits.Add(1) })
			case reserved:
				o.c.count(&o.st, func(k *counters) { k.misses.Add(1) })
				if o.fromDisk(s, i) {
					flush()
					o.copyOut(p, off, i, s.buf[:s.n])
					s.unpin()
					continue
				}
				if derr := o.downErr(); derr != nil {
					// The server does not answer: fail now, and
					// leave the chunks to be fetched later.
					o.c.cache.finish(s, 0, derr)
					s.unpin()
					for _, r := range run {
						o.c.cache.finish(r, 0, derr)
					}
					o.unpinAll(waits)
					return derr
				}
				if len(run) == maxRun || (len(run) > 0 && run[len(run)-1].key.idx != i-1) {
					flush()
				}
				run = append(run, s)
				waits = append(waits, pending{i, s})
			case noSlot:
				flush()
				o.c.count(&o.st, func(k *counters) { k.misses.Add(1); k.direct.Add(1) })
				if err := o.direct(ctx, p, off, i); err != nil {
					o.unpinAll(waits)
					return err
				}
			}
		}
		flush()
		todo = todo[:0]
		for j, w := range waits {
		waiting:
			for {
				select {
				case <-w.s.done:
					break waiting
				case <-ctx.Done():
					o.unpinAll(waits[j:])
					return timedOut()
				case <-down:
					if derr := o.downErr(); derr != nil {
						o.unpinAll(waits[j:])
						return derr
					}
					down = o.woken() // up again meanwhile
				}
			}
			err := w.s.err
			if err == nil {
				o.copyOut(p, off, w.idx, w.s.buf[:w.s.n])
			}
			w.s.unpin()
			switch {
			case err == nil:
			case errors.Is(err, errDropped), errors.Is(err, ErrTimeout), isTransient(err):
				todo = append(todo, w.idx)
				lastErr = err
			default:
				// The chunks still coming were asked at the same
				// time, of a server that refuses: let them land
				// before returning, so that no read after this one
				// joins a fetch of the failure it has reported.
				o.drain(ctx, waits[j+1:])
				return err
			}
		}
	}
	return nil
}

// drain waits for the chunks ws (until ctx ends) and lets go of them.
func (o *Object) drain(ctx context.Context, ws []pending) {
	for _, w := range ws {
		select {
		case <-w.s.done:
		case <-ctx.Done():
		}
		w.s.unpin()
	}
}

func (o *Object) unpinAll(ws []pending) {
	for _, w := range ws {
		w.s.unpin()
	}
}

// fromDisk fills the reserved slot s with chunk idx from the disk cache,
// if it holds it.
func (o *Object) fromDisk(s *slot, idx int64) bool {
	if o.c.disk == nil {
		return false
	}
	n, ok := o.c.disk.get(o.diskKey, idx, s.buf)
	if !ok || n != o.chunkLen(idx) {
		return false
	}
	o.c.cache.finish(s, n, nil)
	o.c.count(&o.st, func(k *counters) { k.diskHits.Add(1) })
	return true
}

// direct reads the part of chunk idx that p needs straight into p, for
// when the cache has no slot to spare (every one pinned or loading).
func (o *Object) direct(ctx context.Context, p []byte, off, idx int64) error {
	cs := o.c.opts.ChunkSize
	lo, hi := max(off, idx*cs), min(off+int64(len(p)), (idx+1)*cs)
	_, err := o.fetch(ctx, lo, [][]byte{p[lo-off : hi-off]}, false)
	return err
}

// startRun fetches the reserved slots of run, adjacent chunks in order, in
// a new goroutine with a pin of its own on each. The fetch runs under the
// Object's context, not the reader's, since other readers may wait for
// these chunks: it ends after Timeout, or at Close.
func (o *Object) startRun(run []*slot, prefetch bool) {
	if !prefetch {
		for _, s := range run {
			s.pins.Add(1) // the reader keeps its own pin
		}
	}
	run = append([]*slot(nil), run...)
	o.mu.Lock()
	if o.closed.Load() {
		o.mu.Unlock()
		for _, s := range run {
			o.c.cache.finish(s, 0, fmt.Errorf("%w: object closed", errDropped))
			s.unpin()
		}
		return
	}
	o.wg.Add(1)
	o.mu.Unlock()
	go func() {
		defer o.wg.Done()
		o.fetchRun(run, prefetch)
	}()
}

func (o *Object) fetchRun(run []*slot, prefetch bool) {
	first := run[0].key.idx
	bufs := make([][]byte, len(run))
	for i, s := range run {
		bufs[i] = s.buf[:o.chunkLen(first+int64(i))]
	}
	ctx, cancel := context.WithTimeout(o.ctx, o.c.opts.Timeout)
	got, err := o.fetch(ctx, first*o.c.opts.ChunkSize, bufs, prefetch)
	cancel()
	if err != nil {
		switch {
		case o.ctx.Err() != nil:
			err = fmt.Errorf("%w: object closed", errDropped)
		case errors.Is(err, ErrChanged):
			o.setChanged(err)
		}
		if prefetch {
			o.c.count(&o.st, func(k *counters) { k.dropped.Add(1) })
			o.c.opts.Log.Debug("remote: prefetch dropped", "url", o.url, "chunk", first, "err", err)
		}
	}
	// Chunks that arrived whole are good even if the run failed later:
	// every byte came under the same version pin.
	var at int64
	for i, s := range run {
		at += int64(len(bufs[i]))
		if at <= got {
			o.c.cache.finish(s, len(bufs[i]), nil)
			if o.c.disk != nil {
				o.c.disk.put(o.diskKey, first+int64(i), bufs[i]) // (a failure is logged, once)
			}
		} else {
			o.c.cache.finish(s, 0, err)
		}
		s.unpin()
	}
}

// prefetch starts fetches of the chunks [from, to) that are not cached, on
// their way, or released lately (cache.past), in runs of adjacent chunks.
// It stops at the first chunk that gets no slot: the cache is busy enough.
func (o *Object) prefetch(from, to int64) {
	if o.downErr() != nil || o.c.opts.Offline {
		return
	}
	maxRun := int(o.c.opts.MaxRequest / o.c.opts.ChunkSize)
	var run []*slot
	flush := func() {
		if len(run) > 0 {
			o.c.count(&o.st, func(k *counters) { k.prefetched.Add(int64(len(run))) })
			o.startRun(run, true)
			run = run[:0]
		}
	}
	for i := from; i < to; i++ {
		if o.c.cache.wasReleased(o.key(i)) {
			flush() // a reader has been through it
			continue
		}
		s, r := o.c.cache.get(o.key(i))
		switch r {
		case noSlot:
			flush()
			return
		case hit, wait:
			s.unpin()
			flush()
			continue
		}
		if o.fromDisk(s, i) {
			s.unpin()
			flush()
			continue
		}
		if len(run) == maxRun {
			flush()
		}
		run = append(run, s)
	}
	flush()
}
