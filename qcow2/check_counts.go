package qcow2

import (
	"slices"
)

// counters are the image check's reference counts, one per host cluster,
// kept in pages allocated where references fall: a file extended sparsely
// to terabytes (billions of clusters) costs the pages its metadata
// touches, not 4 bytes per cluster of the file. Every page is charged to
// the memory budget; a check that would go over it stops (err).
type counters struct {
	pages  map[int64]*counterPage
	charge *charge
	err    error // the first charge that failed
	last   int64 // highest cluster counted; -1 if none
	keys   []int64
	sorted bool
}

const (
	counterPageBits = 12 // 4096 clusters a page: 16 KiB
	counterPageSize = 1 << counterPageBits
	counterPageMask = counterPageSize - 1
)

type counterPage [counterPageSize]uint32

func newCounters(c *charge) *counters {
	return &counters{pages: map[int64]*counterPage{}, charge: c, last: -1}
}

// free gives the pages' memory back.
func (c *counters) free() {
	c.charge.sub(int64(len(c.pages)) * int64(len(counterPage{})*4))
	c.pages = nil
}

// get returns the count of cluster k.
func (c *counters) get(k int64) uint64 {
	if p := c.pages[k>>counterPageBits]; p != nil {
		return uint64(p[k&counterPageMask])
	}
	return 0
}

// add counts n more references to cluster k, at most limit in all; it
// returns how many did not fit (each an overflow).
func (c *counters) add(k, n int64, limit uint64) int64 {
	p := c.pages[k>>counterPageBits]
	if p == nil {
		if c.err != nil {
			return 0
		}
		if err := c.charge.add(int64(len(counterPage{})*4), "image check reference counts"); err != nil {
			c.err = err
			return 0
		}
		p = new(counterPage)
		c.pages[k>>counterPageBits] = p
		c.keys = append(c.keys, k>>counterPageBits)
		c.sorted = false
	}
	c.last = max(c.last, k)
	cur := uint64(p[k&counterPageMask])
	room := int64(limit - cur)
	if n > room {
		p[k&counterPageMask] = uint32(limit)
		return n - room
	}
	p[k&counterPageMask] = uint32(cur + uint64(n))
	return 0
}

// end is one past the highest cluster counted.
func (c *counters) end() int64 { return c.last + 1 }

// any reports whether a cluster of [from, to) has references.
func (c *counters) any(from, to int64) bool {
	for pg := from >> counterPageBits; pg<<counterPageBits < to; pg++ {
		p := c.pages[pg]
		if p == nil {
			continue
		}
		lo := max(from, pg<<counterPageBits) & counterPageMask
		hi := min(to-pg<<counterPageBits, counterPageSize)
		for _, n := range p[lo:hi] {
			if n != 0 {
				return true
			}
		}
	}
	return false
}

// each calls fn, in cluster order, for every cluster of [from, to) with
// references.
func (c *counters) each(from, to int64, fn func(k int64, n uint64)) {
	if from >= to {
		return
	}
	if !c.sorted {
		slices.Sort(c.keys)
		c.sorted = true
	}
	i, _ := slices.BinarySearch(c.keys, from>>counterPageBits)
	for ; i < len(c.keys) && c.keys[i]<<counterPageBits < to; i++ {
		pg := c.keys[i]
		p := c.pages[pg]
		for j, n := range p {
			if k := pg<<counterPageBits + int64(j); n != 0 && k >= from && k < to {
				fn(k, uint64(n))
			}
		}
	}
}
