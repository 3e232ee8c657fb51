package qcow2

import "sync"

// Sector atomicity: a read that overlaps an in-place write returns each
// 512-byte sector either old or new, whole, as a disk does.
//
// An in-place write is one pwrite into the image file's page cache, and a
// reply spliced from there is a copy out of the same pages: the kernel
// orders neither against the other, so a reader racing a writer could see
// a sector half old, half new (mixed at the 16 bytes of one copy
// instruction). On an image open for writing, every read therefore holds
// its guest range shared, from the lookup until its reply has gone to the
// kernel (Image.PinRange), and every in-place write holds its range
// exclusively while it writes. Writes to fresh clusters need nothing: no
// reader sees them before they are linked. A write left in flight
// (behind.go) releases its range once queued: readers of that range wait
// for it to land anyway (layer.readHost, Image.Extent). Read-only images
// take no lock at all.

// rangeLock is a reader-writer lock over guest byte ranges.
type rangeLock struct {
	mu      sync.Mutex
	cond    sync.Cond
	held    []lockedRange
	writers int // exclusive holders and waiters: readers look only then
}

type lockedRange struct {
	start, end int64
	exclusive  bool
	waiting    bool // an exclusive locker waiting: new readers queue behind it
}

func newRangeLock() *rangeLock {
	rl := &rangeLock{}
	rl.cond.L = &rl.mu
	return rl
}

// blocked reports whether [start, end) meets a range held (or, for a
// reader, waited for) by an exclusive locker, or for an exclusive locker
// any range held. skip is the caller's own waiting entry.
func (rl *rangeLock) blocked(start, end int64, exclusive bool, skip int) bool {
	for i, r := range rl.held {
		if i == skip || r.end <= start || end <= r.start {
			continue
		}
		if exclusive {
			if !r.waiting {
				return true
			}
			continue
		}
		if r.exclusive {
			return true
		}
	}
	return false
}

// rlock holds [start, end) shared.
func (rl *rangeLock) rlock(start, end int64) {
	rl.mu.Lock()
	for rl.writers > 0 && rl.blocked(start, end, false, -1) {
		rl.cond.Wait()
	}
	rl.held = append(rl.held, lockedRange{start: start, end: end})
	rl.mu.Unlock()
}

// lock holds [start, end) exclusively. Readers that come meanwhile wait
// behind it.
func (rl *rangeLock) lock(start, end int64) {
	rl.mu.Lock()
	rl.writers++
	rl.held = append(rl.held, lockedRange{start: start, end: end, exclusive: true, waiting: true})
	me := len(rl.held) - 1
	for rl.blocked(start, end, true, me) {
		rl.cond.Wait()
		me = rl.find(start, end, true, true)
	}
	rl.held[me].waiting = false
	rl.mu.Unlock()
}

// find returns the index of an entry for [start, end) of that kind.
func (rl *rangeLock) find(start, end int64, exclusive, waiting bool) int {
	for i, r := range rl.held {
		if r.start == start && r.end == end && r.exclusive == exclusive && r.waiting == waiting {
			return i
		}
	}
	return -1
}

// unlock releases a range rlock or lock took.
func (rl *rangeLock) unlock(start, end int64, exclusive bool) {
	rl.mu.Lock()
	if i := rl.find(start, end, exclusive, false); i >= 0 {
		rl.held[i] = rl.held[len(rl.held)-1]
		rl.held = rl.held[:len(rl.held)-1]
	}
	if exclusive {
		rl.writers--
	}
	rl.cond.Broadcast()
	rl.mu.Unlock()
}
