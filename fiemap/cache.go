package fiemap

import "sync/atomic"

// A run is a data extent [start, end) of the file.
type run struct{ start, end int64 }

// A window is a byte range [start, end) that the host described in full:
// runs are all the data in it, sorted, disjoint and not touching, each
// within the window; everything else in the window is hole. A window never
// changes once cached, except for ref and (under Map.mu) evicted.
type window struct {
	start, end int64
	runs       []run
	ref        atomic.Bool // CLOCK reference bit, set by queries
	evicted    bool        // marked for removal; guarded by Map.mu
}

// search returns the index of the first run that ends after off, or
// len(w.runs) if none does.
func (w *window) search(off int64) int {
	lo, hi := 0, len(w.runs)
	for lo < hi {
		h := int(uint(lo+hi) >> 1)
		if w.runs[h].end <= off {
			lo = h + 1
		} else {
			hi = h
		}
	}
	return lo
}

// touch sets the reference bit, skipping the store (and the cache line
// write it costs other cores) when the bit is already set.
func (w *window) touch() {
	if !w.ref.Load() {
		w.ref.Store(true)
	}
}

// cost is what a window counts against Options.CacheExtents.
func (w *window) cost() int { return len(w.runs) + 1 }

// locate returns the cached window holding off, or nil and where the next
// cached window starts (the file's size if there is none). m.mu must be
// held, for reading at least.
func (m *Map) locate(off int64) (*window, int64) {
	ws := m.windows
	lo, hi := 0, len(ws)
	for lo < hi { // first window starting after off
		h := int(uint(lo+hi) >> 1)
		if ws[h].start <= off {
			lo = h + 1
		} else {
			hi = h
		}
	}
	if lo > 0 && off < ws[lo-1].end {
		return ws[lo-1], 0
	}
	if lo < len(ws) {
		return nil, ws[lo].start
	}
	return nil, m.size
}

// insert caches w, which must not overlap a cached window, then evicts
// down to the budget if it is exceeded. m.mu must be held for writing.
func (m *Map) insert(w *window) {
	lo, hi := 0, len(m.windows)
	for lo < hi { // first window starting after w
		h := int(uint(lo+hi) >> 1)
		if m.windows[h].start < w.start {
			lo = h + 1
		} else {
			hi = h
		}
	}
	m.windows = append(m.windows, nil)
	copy(m.windows[lo+1:], m.windows[lo:])
	m.windows[lo] = w
	if m.hand >= lo {
		m.hand++ // keep the hand on the window it pointed at
	}
	m.cost += w.cost()
	if m.cost > m.budget {
		m.evict(w)
	}
}

// evict removes windows in CLOCK (second chance) order until the cache
// costs at most 7/8 of the budget (the slack spares a sweep on every
// fill), never evicting keep. A window queried since the hand last passed
// it has its reference bit cleared and survives this turn. Victims are
// marked first and removed in one pass, so evicting k windows out of n
// costs O(n + k), not O(n·k). m.mu must be held for writing.
func (m *Map) evict(keep *window) {
	target := m.budget - m.budget/8
	n, live := len(m.windows), len(m.windows)
	for m.cost > target && live > 1 {
		if m.hand >= n {
			m.hand = 0
		}
		v := m.windows[m.hand]
		m.hand++
		switch {
		case v.evicted || v == keep:
		case v.ref.Load():
			v.ref.Store(false)
		default:
			v.evicted = true
			m.cost -= v.cost()
			live--
			m.evictions.Add(1)
		}
	}
	j, hand := 0, -1
	for i, v := range m.windows {
		if i == m.hand {
			hand = j
		}
		if !v.evicted {
			m.windows[j] = v
			j++
		}
	}
	if hand < 0 {
		hand = j
	}
	clear(m.windows[j:])
	m.windows, m.hand = m.windows[:j], hand
}

// appendRun adds [start, end) to runs, which are sorted and end at or
// before start, merging it with the last run when they touch.
func appendRun(runs []run, start, end int64) []run {
	if start >= end {
		return runs
	}
	if n := len(runs); n > 0 && runs[n-1].end >= start {
		runs[n-1].end = max(runs[n-1].end, end)
		return runs
	}
	return append(runs, run{start, end})
}
