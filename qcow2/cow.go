package qcow2

import (
	"math/bits"
	"sync"
)

// Copy-on-write: the parts of a cluster a write does not cover are filled
// from what the cluster reads as now (its backing file, a compressed or
// shared cluster it replaces, zeros), and written together with the guest
// data, merged into one host write where they are contiguous.
//
// Where a part would only be zeros and the host cluster already reads
// zeros (a cluster past the old end of the file, or one whose range was
// punched when it was freed), nothing is written there (qemu's
// c8bb23cbdbe32): a 4 KiB write into an empty image writes 4 KiB, not a
// cluster.

// piece is one stretch of a cluster to write: guest data, or a copy of
// the cluster's current content.
type piece struct {
	host  int64 // where it goes in the data file
	n     int64
	guest int64 // its guest offset
	cow   bool  // copied (else guest data from the write's buffer)
	skip  bool  // a copy of zeros into a cluster that reads zeros: not written
}

// writePlans writes the data of plans: the guest bytes from data, whose
// first byte is at guest offset off, and the copied parts. pin is the
// caller's, held since the plans were made.
func (w *writer) writePlans(plans []clusterPlan, data []byte, off int64, pin Pin) error {
	l := w.l
	cs := l.clusterSize()
	var pieces []piece
	for i := range plans {
		p := &plans[i]
		first := len(pieces)
		base := p.g * cs
		add := func(s, t int64, cow bool) {
			if s < t {
				pieces = append(pieces, piece{host: p.host + s, n: t - s, guest: base + s, cow: cow})
			}
		}
		// In cluster order: copies before the data, the data, copies
		// after it.
		j := 0
		for ; j < len(p.copy) && p.copy[j].end <= p.a; j++ {
			add(p.copy[j].start, p.copy[j].end, true)
		}
		add(p.a, p.b, false)
		for ; j < len(p.copy); j++ {
			add(p.copy[j].start, p.copy[j].end, true)
		}
		if p.zeroed {
			for k := first; k < len(pieces); k++ {
				if q := &pieces[k]; q.cow && w.readsZero(q.guest, q.n) {
					q.skip = true
				}
			}
		}
	}
	// Segments: runs of pieces to write that follow each other on the
	// host, each one write.
	for i := 0; i < len(pieces); {
		if pieces[i].skip {
			w.st.zeroSkipped.Add(pieces[i].n)
			i++
			continue
		}
		j := i + 1
		for j < len(pieces) && !pieces[j].skip && pieces[j].host == pieces[j-1].host+pieces[j-1].n {
			j++
		}
		if err := w.writeSegment(pieces[i:j], data, off, pin); err != nil {
			return err
		}
		i = j
	}
	return nil
}

// writeSegment writes host-contiguous pieces with one write: straight from
// the guest's buffer when it is one piece of guest data, else assembled.
func (w *writer) writeSegment(seg []piece, data []byte, off int64, pin Pin) error {
	start := seg[0].host
	total := seg[len(seg)-1].host + seg[len(seg)-1].n - start
	if len(seg) == 1 && !seg[0].cow {
		q := seg[0]
		w.addHostBytes(q.n, 0)
		return w.host.writeData(data[q.guest-off:q.guest-off+q.n], q.host, pin)
	}
	bp := getBuf(int(total))
	defer putBuf(bp)
	buf := (*bp)[:total]
	var cow int64
	for _, q := range seg {
		dst := buf[q.host-start : q.host-start+q.n]
		if !q.cow {
			copy(dst, data[q.guest-off:])
			continue
		}
		// (Past the end of the disk, zeros: see plan.)
		in := max(0, min(q.n, w.l.vsize()-q.guest))
		clear(dst[in:])
		if in > 0 {
			if _, err := w.img.ReadAt(dst[:in], q.guest); err != nil {
				return err
			}
		}
		cow += q.n
	}
	w.addHostBytes(total, cow)
	return w.host.writeData(buf, start, pin)
}

func (w *writer) addHostBytes(n, cow int64) {
	w.st.hostBytes.Add(n)
	w.st.cowBytes.Add(cow)
}

// readsZero reports whether guest range [off, off+n) of the image reads as
// zeros without any layer storing them (so copying it copies nothing).
func (w *writer) readsZero(off, n int64) bool {
	for end := min(off+n, w.l.vsize()); off < end; {
		e, err := w.l.extent(off, end-off, probeNone)
		if err != nil || e.Status&StatusZero == 0 || e.Status&StatusData != 0 {
			return false
		}
		off += e.Length
	}
	return true
}

// Buffers for assembled writes, by power-of-two size class from 4 KiB.
var bufPools [24]sync.Pool

func bufClass(n int) int {
	if n <= 4096 {
		return 0
	}
	return bits.Len(uint(n-1)) - 12
}

func getBuf(n int) *[]byte {
	c := bufClass(n)
	if c >= len(bufPools) {
		b := make([]byte, n)
		return &b
	}
	if bp, ok := bufPools[c].Get().(*[]byte); ok {
		return bp
	}
	b := make([]byte, 4096<<c)
	return &b
}

func putBuf(bp *[]byte) {
	c := bufClass(cap(*bp))
	if c < len(bufPools) && cap(*bp) == 4096<<c {
		bufPools[c].Put(bp)
	}
}
