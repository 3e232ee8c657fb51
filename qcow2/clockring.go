package qcow2

import "sync/atomic"

// clockEntry is what a clockRing holds: something with a reference bit,
// a size in bytes, and a way to say it must stay (a table with changes not
// yet written back is pinned).
type clockEntry interface {
	refBit() *atomic.Bool
	bytes() int64
	pinned() bool
}

// clockRing is CLOCK (second chance) eviction over entries within a byte
// budget. It is not safe for concurrent use: its owner locks around it.
type clockRing[E clockEntry] struct {
	ring     []E
	hand     int
	used     int64
	capacity int64
}

// add inserts e, first evicting entries (passed to evict) until e fits.
// At least one entry is always kept, so a budget smaller than one entry
// still caches something; and pinned entries are never evicted, so while
// they fill the budget the ring holds more than it (the writer bounds what
// it pins).
func (r *clockRing[E]) add(e E, evict func(E)) {
	for r.used+e.bytes() > r.capacity && len(r.ring) > 0 {
		victim, ok := r.evictOne()
		if !ok {
			break
		}
		evict(victim)
	}
	r.ring = append(r.ring, e)
	r.used += e.bytes()
}

// evictOne advances the hand to the first unpinned entry whose reference
// bit is clear, clearing bits as it passes, and removes and returns that
// entry. After two turns without finding one (everything pinned) it gives
// up.
func (r *clockRing[E]) evictOne() (E, bool) {
	for range 2*len(r.ring) + 1 {
		if r.hand >= len(r.ring) {
			r.hand = 0
		}
		e := r.ring[r.hand]
		if e.pinned() {
			r.hand++
			continue
		}
		if e.refBit().Swap(false) {
			r.hand++
			continue
		}
		return r.removeAt(r.hand), true
	}
	var zero E
	return zero, false
}

func (r *clockRing[E]) removeAt(i int) E {
	e := r.ring[i]
	last := len(r.ring) - 1
	r.ring[i] = r.ring[last]
	var zero E
	r.ring[last] = zero
	r.ring = r.ring[:last]
	r.used -= e.bytes()
	return e
}

// removeIf removes every entry for which drop is true, passing each to
// evict.
func (r *clockRing[E]) removeIf(drop func(E) bool, evict func(E)) {
	for i := 0; i < len(r.ring); {
		if drop(r.ring[i]) {
			evict(r.removeAt(i))
			continue
		}
		i++
	}
}
