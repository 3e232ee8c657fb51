package remote

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// health is whether an Object's server answers. An Object whose read
// timed out (its fetches retried until Options.Timeout without success)
// is down: from then on, a read that needs the network fails at once,
// with an error wrapping ErrTimeout and the cause, instead of waiting out
// the timeout again; readers waiting for chunks in flight are woken with
// it. Without this, a server that stops answering costs a reader several
// timeouts: the kernel retries a failed read in smaller pieces (the page
// it needs, then the rest), each of which would wait the whole timeout.
// Cached chunks (memory and disk) still read. One probe (probe, below)
// asks the server again and again, with backoff, until it answers; then
// the Object is up, and reads fetch again.
//
// mu guards the fields; wake is closed when the Object goes down, and
// replaced when it comes back.
type health struct {
	mu    sync.Mutex
	down  bool
	since time.Time
	cause error
	wake  chan struct{}
}

// downError is the failure of a read or fetch refused because its Object
// is down; it wraps ErrTimeout.
type downError struct {
	since time.Time
	cause error
}

func (e *downError) Error() string {
	return fmt.Sprintf("%v: no answer since %s (%v); reads that need the server fail at once until it answers again",
		ErrTimeout, e.since.Format("15:04:05"), e.cause)
}

func (e *downError) Unwrap() error { return ErrTimeout }

// downErr returns the error of a read refused now, or nil if the Object
// is up.
func (o *Object) downErr() error {
	h := &o.health
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.down {
		return nil
	}
	return &downError{h.since, h.cause}
}

// woken returns a channel closed when the Object goes down.
func (o *Object) woken() <-chan struct{} {
	h := &o.health
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.wake == nil {
		h.wake = make(chan struct{})
	}
	return h.wake
}

// markDown records that a read of o timed out with err, logs it, wakes
// the readers waiting for chunks and starts the probe. Once down, later
// timeouts change nothing.
func (o *Object) markDown(err error) {
	if errors.Is(err, ErrChanged) {
		return
	}
	var de *downError
	if errors.As(err, &de) {
		return // refused because down: nothing new
	}
	h := &o.health
	h.mu.Lock()
	if h.down {
		h.mu.Unlock()
		return
	}
	h.down, h.since, h.cause = true, time.Now(), err
	if h.wake == nil {
		h.wake = make(chan struct{})
	}
	close(h.wake)
	h.mu.Unlock()
	o.c.opts.Log.Warn("remote: the server does not answer; reads of the object that need it fail at once until it answers again",
		"url", o.url, "err", err)
	o.mu.Lock()
	if o.closed.Load() {
		o.mu.Unlock()
		return
	}
	o.wg.Add(1)
	o.mu.Unlock()
	go func() {
		defer o.wg.Done()
		o.probe()
	}()
}

// markUp records that the server answers again.
func (o *Object) markUp() {
	h := &o.health
	h.mu.Lock()
	h.down, h.cause = false, nil
	h.wake = make(chan struct{})
	since := h.since
	h.mu.Unlock()
	o.c.opts.Log.Info("remote: the server answers again; reads fetch again", "url", o.url, "down for", time.Since(since).Round(time.Millisecond))
}

// probe asks for the object's first byte, pinned to its version, with the
// Client's backoff between attempts (each bounded by StallTimeout), until
// the server answers or the Object closes. A probe that finds another
// version marks the Object changed, as a read would.
func (o *Object) probe() {
	buf := make([]byte, 1)
	for i := 0; ; i++ {
		t := time.NewTimer(o.c.backoff(min(i, 30)))
		select {
		case <-t.C:
		case <-o.ctx.Done():
			t.Stop()
			return
		}
		if o.meta.size == 0 {
			o.markUp()
			return
		}
		ctx, cancel := context.WithTimeout(o.ctx, o.c.opts.StallTimeout)
		err := o.c.acquire(ctx, false)
		if err == nil {
			_, _, err = o.c.transfer(ctx, o.be, 0, [][]byte{buf}, &o.meta, &o.st)
			o.c.release(false)
		}
		cancel()
		if o.ctx.Err() != nil {
			return
		}
		switch {
		case err == nil:
			o.markUp()
			return
		case errors.Is(err, ErrChanged):
			o.setChanged(err)
			o.markUp() // its reads fail with ErrChanged from now on
			return
		}
		o.c.opts.Log.Debug("remote: probe failed", "url", o.url, "err", err)
	}
}
