package qcow2

import (
	"sync"
	"sync/atomic"
)

// Write-behind: a large direct write returns before the disk has it.
//
// A guest streaming 1 MiB writes at queue depth one (dd oflag=direct, a
// loop device's writeback) sends its next write only when the last one
// returned, so a write that waits for the disk leaves the disk idle while
// the next one crosses FUSE, and FUSE idle while the disk writes. A write
// that goes to the host with O_DIRECT (direct.go) is therefore copied into
// a buffer of its own and written by a goroutine, and WriteAt returns once
// it is queued: the two overlap, as a raw file's page cache makes them
// overlap.
//
// What the guest can see is unchanged:
//   - a read of the host range waits for the write in flight there
//     (layer.readHost, Image.Extent), and so does every other write or
//     punch of that range, in the order they came;
//   - the write holds a pin until it lands, so that a discard meanwhile
//     cannot have its clusters reused under it;
//   - a flush (and Close) waits for every write in flight before it
//     syncs, and a write that failed fails that flush and every later one,
//     as a buffered write that fails in the page cache's writeback does.
//
// What is in flight is bounded by behindMax bytes, the memory it costs.

// behindMax bounds the bytes of writes in flight.
const behindMax = 8 << 20

// behind is a data file's writes in flight.
type behind struct {
	n atomic.Int32 // writes in flight: readers look no further when 0
	// waiting counts callers blocked on a write in flight (or on room).
	waiting atomic.Int32
	mu      sync.Mutex
	cond    sync.Cond
	spans   []hostRange // host ranges in flight
	bytes   int64       // their total
}

func newBehind() *behind {
	b := &behind{}
	b.cond.L = &b.mu
	return b
}

// overlaps reports whether [off, end) meets a write in flight; b.mu held.
func (b *behind) overlaps(off, end int64) bool {
	for _, s := range b.spans {
		if off < s.end && s.start < end {
			return true
		}
	}
	return false
}

// idle reports whether no write is in flight.
func (b *behind) idle() bool { return b.n.Load() == 0 }

// wait returns once no write in flight meets host range [off, end).
func (b *behind) wait(off, end int64) {
	if b == nil || b.n.Load() == 0 {
		return
	}
	b.mu.Lock()
	for b.overlaps(off, end) {
		b.block()
	}
	b.mu.Unlock()
}

// block waits for the next write to land; b.mu held.
func (b *behind) block() {
	b.waiting.Add(1)
	b.cond.Wait()
	b.waiting.Add(-1)
}

// drain returns once no write is in flight.
func (b *behind) drain() {
	if b == nil || b.n.Load() == 0 {
		return
	}
	b.mu.Lock()
	for len(b.spans) > 0 {
		b.block()
	}
	b.mu.Unlock()
}

// add waits until nothing in flight meets [off, end) and there is room for
// it, then records it as in flight.
func (b *behind) add(off, end int64) {
	b.mu.Lock()
	for b.overlaps(off, end) || (b.bytes > 0 && b.bytes+end-off > behindMax) {
		b.block()
	}
	b.spans = append(b.spans, hostRange{start: off, end: end})
	b.bytes += end - off
	b.n.Add(1)
	b.mu.Unlock()
}

// done records that the write of [off, end) landed (or failed).
func (b *behind) done(off, end int64) {
	b.mu.Lock()
	for i, s := range b.spans {
		if s.start == off && s.end == end {
			b.spans = append(b.spans[:i], b.spans[i+1:]...)
			break
		}
	}
	b.bytes -= end - off
	b.n.Add(-1)
	b.cond.Broadcast()
	b.mu.Unlock()
}
