package remote

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Hydration: an Object's needed byte ranges (the caller says which: for a
// qcow2 image, its metadata and data clusters, never its holes) fetched
// into the disk cache in the background, lowest offsets first, so that
// once it is complete the object's reads of those ranges never touch the
// network. It runs beside the readers without delaying them:
//
//   - its requests take the prefetches' share of the connections
//     (acquire with ahead set: at most Connections-2 of them together),
//     so a reader always finds a connection soon;
//   - at most hydrateWorkers runs are in flight per Object, each of
//     adjacent missing chunks, up to MaxRequest bytes;
//   - chunks go to the disk cache only, never into the memory cache,
//     whose chunks are the readers' own;
//   - Options.HydrateRate caps the bytes a second of all hydrations of
//     the Client together.
//
// A chunk already in the disk cache (a second mount of the same version,
// or a reader's fetch, also one made while the run holding the chunk
// waited for its turn under the rate cap) is not fetched again. A chunk
// a reader fetches while hydration's request for it is in flight is
// fetched twice; nothing else is. The chunks hydrated count against
// CacheDirSize: once the next run would pass it, the hydration stops,
// bounded, and logs a line saying how far it got. It ends early with the Object (Close) or when the object
// changed; a run that fails for a while is retried with backoff.

// A Span is a byte range of an object.
type Span struct{ Off, Len int64 }

// HydrationStatus is what Client.Stats reports of one hydration.
type HydrationStatus struct {
	URL     string `json:"url"`     // redacted
	Version string `json:"version"` // the object version hydrated
	// Needed is the bytes of the spans asked for; Done, those of them
	// whose chunks are in the disk cache, fetched or found there;
	// Fetched, the bytes hydration downloaded (whole chunks).
	Needed  int64   `json:"needed"`
	Done    int64   `json:"done"`
	Fetched int64   `json:"fetched"`
	Percent float64 `json:"percent"`
	Rate    int64   `json:"rate"` // bytes fetched a second, since it started (until it ended)
	// State is "running", "complete", "bounded" (stopped at the disk
	// cache's bound), "failed" or "stopped" (the object was closed).
	State string `json:"state"`
	Error string `json:"error,omitempty"`
}

// hydrateWorkers is how many runs one hydration has in flight.
const hydrateWorkers = 4

// A Hydration is one Object's background download into the disk cache.
type Hydration struct {
	o       *Object
	started time.Time
	needed  int64
	done    atomic.Int64
	fetched atomic.Int64
	end     chan struct{} // closed when it ends

	mu    sync.Mutex
	state string
	err   error
	ended time.Time
}

// Done returns a channel closed when the hydration has ended, however.
func (h *Hydration) Done() <-chan struct{} { return h.end }

// Status returns the hydration's progress.
func (h *Hydration) Status() HydrationStatus {
	h.mu.Lock()
	state, err, ended := h.state, h.err, h.ended
	h.mu.Unlock()
	s := HydrationStatus{URL: h.o.url, Version: h.o.meta.version(), Needed: h.needed,
		Done: h.done.Load(), Fetched: h.fetched.Load(), State: state}
	if s.Needed > 0 {
		s.Percent = float64(int64(float64(s.Done)/float64(s.Needed)*1000)) / 10
	} else {
		s.Percent = 100
	}
	if ended.IsZero() {
		ended = time.Now()
	}
	if d := ended.Sub(h.started); d > 0 {
		s.Rate = int64(float64(s.Fetched) / d.Seconds())
	}
	if err != nil {
		s.Error = err.Error()
	}
	return s
}

func (h *Hydration) finish(state string, err error) {
	h.mu.Lock()
	h.state, h.err, h.ended = state, err, time.Now()
	h.mu.Unlock()
	close(h.end)
}

// hydrateChunk is one chunk of a hydration and the bytes of the spans in
// it.
type hydrateChunk struct {
	idx    int64
	needed int64
}

// Hydrate starts fetching the chunks of spans (byte ranges of o, in any
// order, overlapping or not) into the disk cache, in the background, and
// returns at once. It needs a disk cache (Options.CacheDir).
func (o *Object) Hydrate(spans []Span) (*Hydration, error) {
	if o.c.disk == nil {
		return nil, errors.New("remote: hydration needs a disk cache (CacheDir)")
	}
	if o.c.opts.Offline {
		return nil, fmt.Errorf("remote: hydration fetches: %w", ErrOffline)
	}
	chunks := o.neededChunks(spans)
	h := &Hydration{o: o, started: time.Now(), end: make(chan struct{}), state: "running"}
	for _, k := range chunks {
		h.needed += k.needed
	}
	o.c.hydMu.Lock()
	o.c.hydrations = append(o.c.hydrations, h)
	o.c.hydMu.Unlock()
	o.mu.Lock()
	if o.closed.Load() {
		o.mu.Unlock()
		h.finish("stopped", ErrClosed)
		return h, nil
	}
	o.wg.Add(1)
	o.mu.Unlock()
	go func() {
		defer o.wg.Done()
		o.hydrate(h, chunks)
	}()
	return h, nil
}

// neededChunks are the chunks spans touch, in order, each with the bytes
// of the spans within it (overlaps counted once).
func (o *Object) neededChunks(spans []Span) []hydrateChunk {
	cs := o.c.opts.ChunkSize
	s := slices.Clone(spans)
	slices.SortFunc(s, func(a, b Span) int { return cmp.Compare(a.Off, b.Off) })
	var out []hydrateChunk
	var reach int64 // spans are counted up to here already
	for _, sp := range s {
		lo, hi := max(sp.Off, reach, 0), min(sp.Off+sp.Len, o.meta.size)
		for lo < hi {
			idx := lo / cs
			end := min(hi, (idx+1)*cs)
			if n := len(out); n > 0 && out[n-1].idx == idx {
				out[n-1].needed += end - lo
			} else {
				out = append(out, hydrateChunk{idx, end - lo})
			}
			lo = end
		}
		reach = max(reach, hi)
	}
	return out
}

// hydrate runs h over chunks: in runs of adjacent chunks missing from the
// disk cache, lowest first, hydrateWorkers at a time.
func (o *Object) hydrate(h *Hydration, chunks []hydrateChunk) {
	c := o.c
	maxRun := int(c.opts.MaxRequest / c.opts.ChunkSize)
	runs := make(chan []hydrateChunk)
	var (
		failMu   sync.Mutex
		firstErr error
	)
	fail := func(err error) {
		failMu.Lock()
		if firstErr == nil {
			firstErr = err
		}
		failMu.Unlock()
	}
	failed := func() bool {
		failMu.Lock()
		defer failMu.Unlock()
		return firstErr != nil
	}
	var wg sync.WaitGroup
	for range hydrateWorkers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for run := range runs {
				if failed() {
					continue
				}
				if err := o.hydrateRun(h, run); err != nil {
					fail(err)
				}
			}
		}()
	}
	bounded := false
	var run []hydrateChunk
	send := func() bool {
		if len(run) == 0 {
			return true
		}
		select {
		case runs <- run:
		case <-o.ctx.Done():
			return false
		}
		run = nil
		return true
	}
	for _, k := range chunks {
		if failed() || o.ctx.Err() != nil {
			break
		}
		// Every chunk hydrated, found or fetched, takes its place in
		// the disk cache.
		if !c.hydrateReserve(int64(o.chunkLen(k.idx)) + diskTrailer) {
			bounded = true
			break
		}
		if c.disk.has(o.diskKey, k.idx) {
			h.done.Add(k.needed)
			continue
		}
		if len(run) == maxRun || (len(run) > 0 && run[len(run)-1].idx != k.idx-1) {
			if !send() {
				break
			}
		}
		run = append(run, k)
	}
	if !failed() && o.ctx.Err() == nil {
		send()
	}
	close(runs)
	wg.Wait()
	switch {
	case firstErr != nil:
		c.opts.Log.Warn("remote: hydration failed; reads fetch what they need as before", "url", o.url, "err", firstErr)
		h.finish("failed", firstErr)
	case o.ctx.Err() != nil:
		h.finish("stopped", ErrClosed)
	case bounded:
		c.opts.Log.Warn("remote: hydration stopped at the disk cache's bound (--cache-dir-size)", "url", o.url,
			"done", h.done.Load(), "needed", h.needed, "bound", c.opts.CacheDirSize)
		h.finish("bounded", nil)
	default:
		c.opts.Log.Info("remote: hydration complete", "url", o.url, "bytes", h.needed, "fetched", h.fetched.Load(),
			"took", time.Since(h.started).Round(time.Millisecond))
		h.finish("complete", nil)
	}
}

// hydrateRun fetches run (adjacent chunks) into the disk cache, under the
// rate cap, retrying a failure worth retrying with backoff while the
// Object lasts, at most Timeout per attempt and hydrateAttempts attempts.
func (o *Object) hydrateRun(h *Hydration, run []hydrateChunk) error {
	c := o.c
	var n int64
	for _, k := range run {
		n += int64(o.chunkLen(k.idx))
	}
	if err := c.hydrateWait(o.ctx, n); err != nil {
		return nil // closed: hydrate says so
	}
	// Readers may have fetched some of the chunks meanwhile (a capped
	// hydration waits its turn for long): those are in the disk cache
	// now, and the rest goes in runs of what is still missing.
	for len(run) > 0 {
		i := 0
		for i < len(run) && c.disk.has(o.diskKey, run[i].idx) {
			h.done.Add(run[i].needed)
			i++
		}
		j := i
		for j < len(run) && !c.disk.has(o.diskKey, run[j].idx) {
			j++
		}
		if i < j {
			if err := o.hydrateFetch(h, run[i:j]); err != nil {
				return err
			}
		}
		run = run[j:]
	}
	return nil
}

// hydrateFetch fetches run (adjacent chunks, at most MaxRequest bytes)
// into the disk cache, retrying as hydrateRun says.
func (o *Object) hydrateFetch(h *Hydration, run []hydrateChunk) error {
	c := o.c
	first := run[0].idx
	off := first * c.opts.ChunkSize
	// One buffer of MaxRequest bytes per run in flight, reused: a
	// hydration of an image passes all of it through them.
	bp, _ := c.hydBufs.Get().(*[]byte)
	if bp == nil {
		b := make([]byte, c.opts.MaxRequest)
		bp = &b
	}
	defer c.hydBufs.Put(bp)
	bufs := make([][]byte, len(run))
	var n int64
	for i, k := range run {
		l := int64(o.chunkLen(k.idx))
		bufs[i] = (*bp)[n : n+l : n+l]
		n += l
	}
	if o.ctx.Err() != nil {
		return nil
	}
	for i := 0; ; i++ {
		ctx, cancel := context.WithTimeout(o.ctx, c.opts.Timeout)
		got, err := o.fetch(ctx, off, bufs, true)
		cancel()
		if err == nil && got == n {
			break
		}
		if o.ctx.Err() != nil {
			return nil
		}
		if errors.Is(err, ErrChanged) {
			o.setChanged(err)
			return err
		}
		if i+1 == hydrateAttempts {
			return fmt.Errorf("chunks %d to %d: %w", first, first+int64(len(run))-1, err)
		}
		c.count(&o.st, func(k *counters) { k.retries.Add(1) })
		t := time.NewTimer(c.backoff(min(i+3, 30)))
		select {
		case <-t.C:
		case <-o.ctx.Done():
			t.Stop()
			return nil
		}
	}
	h.fetched.Add(n)
	for i, k := range run {
		// Only what the disk cache holds is done: a chunk it could
		// not store (its file system full) fails the hydration, whose
		// point was to have it on disk.
		if err := c.disk.put(o.diskKey, k.idx, bufs[i]); err != nil {
			return errStore{err}
		}
		h.done.Add(k.needed)
	}
	return nil
}

// errStore is a chunk hydration fetched that the disk cache could not
// store.
type errStore struct{ err error }

func (e errStore) Error() string { return "cannot store chunks: " + e.err.Error() }
func (e errStore) Unwrap() error { return e.err }

// hydrateAttempts bounds the attempts at one run: a server that fails
// this often fails the hydration (the readers go on as before).
const hydrateAttempts = 10

// hydrateReserve counts n bytes of disk cache for a hydration run, or
// says false if that would pass CacheDirSize.
func (c *Client) hydrateReserve(n int64) bool {
	c.hydMu.Lock()
	defer c.hydMu.Unlock()
	if c.hydUsed+n > c.opts.CacheDirSize {
		return false
	}
	c.hydUsed += n
	return true
}

// hydrateWait waits until n more bytes keep within Options.HydrateRate,
// or ctx ends. Bytes are paid for before they are fetched: a run waits
// until the runs before it have had their time (hydNext), and moves it
// on by its own; after an idle spell the clock starts again from now. So
// over any window the bytes fetched are at most the rate's worth plus
// the runs in flight.
func (c *Client) hydrateWait(ctx context.Context, n int64) error {
	rate := c.opts.HydrateRate
	if rate <= 0 {
		return ctx.Err()
	}
	c.hydMu.Lock()
	now := time.Now()
	if c.hydNext.Before(now) {
		c.hydNext = now
	}
	at := c.hydNext
	c.hydNext = c.hydNext.Add(time.Duration(float64(n) / float64(rate) * float64(time.Second)))
	c.hydMu.Unlock()
	if d := time.Until(at); d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return ctx.Err()
}

// Hydrations returns the status of every hydration the Client started.
func (c *Client) Hydrations() []HydrationStatus {
	c.hydMu.Lock()
	hs := slices.Clone(c.hydrations)
	c.hydMu.Unlock()
	out := make([]HydrationStatus, 0, len(hs))
	for _, h := range hs {
		out = append(out, h.Status())
	}
	return out
}
