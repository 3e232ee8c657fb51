package qcow2

import "sync/atomic"

// Pins: when a freed host cluster may be used again.
//
// Pins are taken by the read path (ReadAt, and Pin and PinRange below for
// reads the caller makes itself) and by the writer's writes; the writer's
// free lists (freeing.go) ask them when a freed cluster may be reused.
//
// A request that maps a guest range to host clusters and then reads or
// writes them (a read, a zero-copy reply that the FUSE layer splices after
// the request returned, an in-place write) holds a pin from before the
// lookup until its last host access. A cluster freed while pins older than
// the free exist must not be reused before they are released, or the old
// request would read another guest offset's new data (or write over it).
//
// This is a two-phase epoch scheme: pins count into the slot of the epoch
// current when they were taken. A freed cluster is tagged with the epoch
// current when its refcount dropped; it is reusable once the epoch has
// moved on twice, which requires each older slot to have drained. Taking
// and releasing a pin are two atomic adds; nothing ever waits: a cluster
// that is not yet reusable simply is not reused yet.
type pins struct {
	epoch atomic.Uint64
	count [2]atomic.Int64
}

// A Pin keeps the host clusters a request mapped from being reused; see
// Image.Pin. A pin from Image.PinRange also holds its guest range against
// in-place writes (sectorlock.go).
type Pin struct {
	p          *pins
	e          uint64
	rl         *rangeLock
	start, end int64
}

// take returns a pin in the current epoch.
func (p *pins) take() Pin {
	for {
		e := p.epoch.Load()
		p.count[e&1].Add(1)
		if p.epoch.Load() == e {
			return Pin{p: p, e: e}
		}
		// The epoch moved while we counted in: count in the new one.
		p.count[e&1].Add(-1)
	}
}

// Release ends the pin. Releasing the zero Pin does nothing.
func (pin Pin) Release() {
	if pin.rl != nil {
		pin.rl.unlock(pin.start, pin.end, false)
	}
	if pin.p != nil {
		pin.p.count[pin.e&1].Add(-1)
	}
}

// dup returns another pin of pin's epoch, for work that outlives pin's
// holder but was mapped under it (a write in flight, behind.go); pin must
// be held. Counting in pin's slot, not the current epoch's, keeps what was
// freed before pin's lookup from being reused until both are released.
func (pin Pin) dup() Pin {
	if pin.p != nil {
		pin.p.count[pin.e&1].Add(1)
	}
	return Pin{p: pin.p, e: pin.e}
}

// now returns the current epoch: what is freed now is tagged with it.
func (p *pins) now() uint64 { return p.epoch.Load() }

// advance moves the epoch on if the slot it would reuse has drained, and
// returns the current epoch.
func (p *pins) advance() uint64 {
	e := p.epoch.Load()
	if p.count[(e+1)&1].Load() == 0 {
		p.epoch.CompareAndSwap(e, e+1)
	}
	return p.epoch.Load()
}

// settle moves the epoch on as far as the drained slots allow (twice at
// most), and returns it. Something freed in epoch tag may be reused once
// settle returns tag+2 or more: no pin taken in that epoch or before is
// left.
func (p *pins) settle() uint64 {
	p.advance()
	return p.advance()
}

// Pin keeps the host clusters a caller is about to find with Extent (and
// read or splice from their host files) from being reused for other data
// by a concurrent write, until Release. ReadAt pins by itself.
func (img *Image) Pin() Pin { return img.pins.take() }

// PinRange is Pin for a read of guest range [off, off+n) that lasts until
// Release: on an image open for writing it also holds the range against
// in-place writes, so that the read sees each sector whole, old or new
// (sectorlock.go). Release it once the bytes have been copied out (for a
// spliced reply, after it has gone to the kernel).
func (img *Image) PinRange(off, n int64) Pin {
	pin := img.pins.take()
	if w := img.w; w != nil && n > 0 {
		w.sectors.rlock(off, off+n)
		pin.rl, pin.start, pin.end = w.sectors, off, off+n
	}
	return pin
}
