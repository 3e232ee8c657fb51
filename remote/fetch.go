package remote

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"time"
)

// errStalled is the cause given to a request's context when no byte
// arrived for Options.StallTimeout.
var errStalled = errors.New("stalled")

// transfer sends one request for len(bufs) bytes at off (the sum of the
// buffers' lengths) and reads the body into bufs, in order. It returns the
// bytes read, which are good even when err is not nil: a request cut short
// is resumed by the next attempt where this one stopped. With pin nil
// (open), the object may end before the buffers do, and the meta returned
// describes it.
//
// A request that receives nothing for StallTimeout, headers or body, is
// aborted and reported as a transient failure.
func (c *Client) transfer(ctx context.Context, be backend, off int64, bufs [][]byte, pin *meta, st *counters) (meta, int64, error) {
	var want int64
	for _, b := range bufs {
		want += int64(len(b))
	}
	actx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stall := c.opts.StallTimeout
	dog := time.AfterFunc(stall, func() { cancel(errStalled) })
	defer dog.Stop()

	c.count(st, func(k *counters) { k.requests.Add(1) })
	body, m, err := be.get(actx, off, want, pin)
	if err != nil {
		return m, 0, stalled(actx, stall, err)
	}
	if body == nil {
		return m, 0, nil // an empty object
	}
	defer body.Close()
	if pin == nil {
		want = min(want, m.size-off)
	}
	var got int64
	for i := 0; got < want; {
		b := bufs[i]
		k, rerr := body.Read(b[:min(int64(len(b)), want-got)])
		if k > 0 {
			got += int64(k)
			dog.Reset(stall)
			if k == len(b) {
				i++
			} else {
				bufs[i] = b[k:] // bufs is the caller's scratch copy
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			c.count(st, func(k *counters) { k.bytes.Add(got) })
			return m, got, stalled(actx, stall, transient(fmt.Errorf("body cut after %d of %d bytes: %w", got, want, netError(actx, rerr))))
		}
	}
	c.count(st, func(k *counters) { k.bytes.Add(got) })
	if got < want {
		return m, got, transient(fmt.Errorf("short body: %d of %d bytes", got, want))
	}
	return m, got, nil
}

// stalled turns the error of a request whose context the stall watchdog
// cancelled into a transient "stalled" error.
func stalled(ctx context.Context, d time.Duration, err error) error {
	if context.Cause(ctx) == errStalled {
		return transient(fmt.Errorf("no byte received for %v", d))
	}
	return err
}

// fetch reads len(bufs) bytes at off into bufs (as transfer does), retrying
// transient failures until ctx ends. A prefetch makes one attempt, once it
// has a connection (acquire). It returns how many bytes arrived, in
// order, even when it fails.
func (o *Object) fetch(ctx context.Context, off int64, bufs [][]byte, prefetch bool) (int64, error) {
	if o.c.opts.Offline {
		return 0, offlineMiss(off, bufs)
	}
	var done int64
	scratch := make([][]byte, len(bufs))
	err := o.c.retry(ctx, &o.st, prefetch, func(ctx context.Context) error {
		if err := o.downErr(); err != nil {
			return err // the probe asks the server meanwhile (health.go)
		}
		if err := o.c.acquire(ctx, prefetch); err != nil {
			return err
		}
		defer o.c.release(prefetch)
		rest := scratch[:0]
		skip := done
		for _, b := range bufs {
			if skip >= int64(len(b)) {
				skip -= int64(len(b))
				continue
			}
			rest = append(rest, b[skip:])
			skip = 0
		}
		_, got, err := o.c.transfer(ctx, o.be, off+done, rest, &o.meta, &o.st)
		done += got
		if err != nil && ctx.Err() == nil {
			o.lastFail.Store(&err)
		}
		return err
	})
	return done, err
}

// retry runs attempt until it succeeds, fails for good, or ctx ends, with
// exponential backoff and jitter between attempts. A failure that outlives
// ctx becomes an error wrapping ErrTimeout and the last failure. once
// allows a single attempt.
func (c *Client) retry(ctx context.Context, st *counters, once bool, attempt func(context.Context) error) error {
	var last error
	for i := 0; ; i++ {
		err := attempt(ctx)
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return c.expired(ctx, err, last)
		}
		if !isTransient(err) || once {
			return err
		}
		last = err
		d := c.backoff(i)
		if we, ok := errors.AsType[*waitError](err); ok {
			d = max(d, we.after)
		}
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) < d {
			return fmt.Errorf("%w (gave up after %d attempts, %v): %w", ErrTimeout, i+1, c.opts.Timeout, err)
		}
		c.count(st, func(k *counters) { k.retries.Add(1) })
		c.opts.Log.Debug("remote: retrying", "attempt", i+1, "in", d, "err", err)
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return c.expired(ctx, err, last)
		}
	}
}

// expired is the error of an operation whose context ended.
func (c *Client) expired(ctx context.Context, err, last error) error {
	if errors.Is(ctx.Err(), context.Canceled) {
		return err
	}
	cause := err
	if last != nil && (errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)) {
		cause = last // say what kept failing, not that time ran out
	}
	if errors.Is(cause, ErrTimeout) {
		return cause
	}
	if errors.Is(cause, context.DeadlineExceeded) {
		return fmt.Errorf("%w: no answer within %v", ErrTimeout, c.opts.Timeout)
	}
	return fmt.Errorf("%w (%v): %w", ErrTimeout, c.opts.Timeout, cause)
}

// backoff is the wait before retry i+1: full-range jitter over the upper
// half of min(RetryMax, RetryBase*2^i), so concurrent readers that failed
// together do not retry together.
func (c *Client) backoff(i int) time.Duration {
	d := c.opts.RetryMax
	if i < 30 {
		d = min(d, c.opts.RetryBase<<i)
	}
	return d/2 + rand.N(d/2+1)
}

// acquire takes one of the Client's connections, waiting for ctx at most.
// A prefetch (ahead) waits for a connection too, but prefetches hold at
// most Connections-2 of them together, so that a reader that needs a chunk
// now finds a connection soon however far ahead the sequential readers
// are. (Dropping a prefetch when no connection was free at once, as
// before, dropped most of a large readahead window: the reader then
// fetched the same chunks itself, one small request at a time.)
func (c *Client) acquire(ctx context.Context, ahead bool) error {
	if ahead {
		select {
		case c.ahead <- struct{}{}:
		case <-ctx.Done():
			return fmt.Errorf("%w: %w", errDropped, ctx.Err())
		case <-c.ctx.Done():
			return ErrClosed
		}
	}
	select {
	case c.conns <- struct{}{}:
		return nil
	case <-ctx.Done():
		err := ctx.Err()
		if ahead {
			<-c.ahead
			err = fmt.Errorf("%w: %w", errDropped, err)
		}
		return err
	case <-c.ctx.Done():
		if ahead {
			<-c.ahead
		}
		return ErrClosed
	}
}

// release gives back a connection taken by acquire(ctx, ahead).
func (c *Client) release(ahead bool) {
	<-c.conns
	if ahead {
		<-c.ahead
	}
}
