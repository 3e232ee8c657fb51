package readahead

import "sync"

// bufPool hands out window buffers within a byte bound. Buffers come in a
// few size classes, sizes[0] = MinWindow doubling up to sizes[last] =
// MaxWindow, and spare ones wait in one sync.Pool per class, so the garbage
// collector reclaims what an idle Reader no longer needs.
//
// All fields are guarded by Reader.mu (the sync.Pools are safe anyway).
type bufPool struct {
	sizes  []int
	pools  []sync.Pool // spare buffers of sizes[i], as *[]byte
	inUse  int64       // bytes of buffers handed out and not yet put back
	peak   int64       // the most inUse has been
	limit  int64       // inUse never exceeds limit
	closed bool        // put drops buffers instead of keeping them
}

func (p *bufPool) init(minSize, maxSize int, limit int64) {
	for s := minSize; s < maxSize; s *= 2 {
		p.sizes = append(p.sizes, s)
	}
	p.sizes = append(p.sizes, maxSize)
	p.pools = make([]sync.Pool, len(p.sizes))
	p.limit = limit
}

// class returns the smallest size class holding n bytes, or -1.
func (p *bufPool) class(n int64) int {
	for i, s := range p.sizes {
		if int64(s) >= n {
			return i
		}
	}
	return -1
}

// get returns a buffer of size class c, or nil if it would take the bytes
// in use past the limit.
func (p *bufPool) get(c int) *[]byte {
	size := int64(p.sizes[c])
	if p.closed || p.inUse+size > p.limit {
		return nil
	}
	bp, _ := p.pools[c].Get().(*[]byte)
	if bp == nil {
		b := make([]byte, p.sizes[c])
		bp = &b
	}
	p.inUse += size
	p.peak = max(p.peak, p.inUse)
	return bp
}

// put takes back a buffer of size class c.
func (p *bufPool) put(c int, bp *[]byte) {
	p.inUse -= int64(len(*bp))
	if !p.closed {
		p.pools[c].Put(bp)
	}
}

// close drops the spare buffers and makes put drop the rest as they come
// back.
func (p *bufPool) close() {
	p.closed = true
	p.pools = nil
}
