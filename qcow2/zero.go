package qcow2

import "fmt"

// Zeroing and discarding guest ranges: whole clusters change their L2
// entries (unallocated, or zero clusters), their host clusters are freed
// (freeing.go) once that is durable; the parts of partial clusters get
// zeros written.

// zeroes is a source of zero bytes for writes, never written to.
var zeroes = make([]byte, 1<<20)

// Discard makes guest range [off, off+n) read as zeros and gives its host
// clusters back: whole clusters become unallocated, or zero clusters where
// a backing file would otherwise show through (on compat 0.10 images,
// which have no zero clusters, zeros are written there); their host
// clusters are freed (and punched) once that is durable. The parts of
// partial clusters are zeroed.
func (img *Image) Discard(off, n int64) error { return img.zero(off, n, false) }

// WriteZeroes makes guest range [off, off+n) read as zeros: whole clusters
// become zero clusters, keeping a host cluster the image owns (as qemu's
// write-zeroes without unmap does); partial clusters get zeros written.
func (img *Image) WriteZeroes(off, n int64) error { return img.zero(off, n, true) }

func (img *Image) zero(off, n int64, keep bool) error {
	w := img.w
	if w == nil {
		return img.readOnly()
	}
	size := img.Size()
	if off < 0 || n < 0 || off > size {
		return fmt.Errorf("%s: zeroing [%d, +%d): %w (%d bytes)", img.top.name, off, n, ErrNoSpace, size)
	}
	n = min(n, size-off)
	if n == 0 {
		return nil
	}
	if err := w.start(off, n); err != nil {
		return err
	}
	l := w.l
	cs := l.clusterSize()
	end := off + n
	// Whole clusters, and the end of the disk counts as a cluster's end.
	a := (off + cs - 1) / cs * cs
	b := end / cs * cs
	if end == size {
		b = (end + cs - 1) / cs * cs
	}
	if a >= b {
		return w.zeroBytes(off, n)
	}
	if err := w.zeroBytes(off, a-off); err != nil {
		return err
	}
	if err := w.zeroBytes(min(b, end), end-min(b, end)); err != nil {
		return err
	}
	l2Span := cs << l.l2Bits
	for pos := a; pos < b; {
		step := min(b-pos, l2Span-pos&(l2Span-1))
		if err := w.zeroClusters(pos, step, keep); err != nil {
			return err
		}
		pos += step
	}
	return nil
}

// zeroBytes writes zeros over [off, off+n), unless it reads as zeros
// already.
func (w *writer) zeroBytes(off, n int64) error {
	for n > 0 && !w.readsZero(off, n) {
		k := min(n, int64(len(zeroes)))
		if _, err := w.img.WriteAt(zeroes[:k], off); err != nil {
			return err
		}
		off, n = off+k, n-k
	}
	return nil
}

// zeroClusters zeroes whole clusters [off, off+n) inside one L2 table.
func (w *writer) zeroClusters(off, n int64, keep bool) error {
	l := w.l
	cs := l.clusterSize()
	hasBacking := l.backing != nil
	if l.hdr.Version < 3 {
		// No zero clusters: unallocated reads zeros only without a
		// backing file; with one, write the zeros.
		if hasBacking {
			for pos := off; pos < off+n; pos += int64(len(zeroes)) {
				k := min(off+n-pos, int64(len(zeroes)))
				if _, err := w.img.WriteAt(zeroes[:k], pos); err != nil {
					return err
				}
			}
			return nil
		}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.holds.hold(off, off+n)
	defer w.holds.unhold(off, off+n)
	if err := w.host.usable(); err != nil {
		return err
	}
	l1i := off >> (l.clusterBits + l.l2Bits)
	t := l.l1.Load()
	if l1i >= t.len() {
		return fmt.Errorf("%s: zeroing at %d: past the L1 table", l.name, off)
	}
	if t.entry(l1i).l2Offset() == 0 && !hasBacking {
		return nil // unallocated, and nothing shows through: zeros
	}
	tab, _, err := w.ownedL2(l1i)
	if err != nil {
		return err
	}
	external := l.external()
	allZero := uint64(subclusterAllocMask) << 32
	for g := off / cs; g < (off+n)/cs; g++ {
		idx := g & (1<<l.l2Bits - 1)
		e := tab.entry(idx, l.extendedL2)
		owned := !e.compressed() && e.allocated(external) && e.copied()
		var next l2Entry
		switch {
		case keep && owned && l.hdr.Version >= 3:
			// A zero cluster that keeps its host cluster.
			next.word = e.word&(l2OffsetMask|oflagCopied) | oflagZero
			if l.extendedL2 {
				next.word &^= oflagZero
				next.bitmap = allZero
			}
		case hasBacking || l.hdr.Version >= 3 && keep:
			// A zero cluster, so the backing file does not show.
			next.word = oflagZero
			if l.extendedL2 {
				next.word, next.bitmap = 0, allZero
			}
		default:
			// Unallocated: nothing below, so it reads zeros.
		}
		if next == e {
			continue
		}
		// What the entry stops naming is freed once the change is
		// durable (free refuses, before the change, to free metadata).
		if !external && next.word&l2OffsetMask == 0 {
			if first, k := w.referenced(e); k > 0 {
				if err := w.frees.free(first, k, 0); err != nil {
					return err
				}
			}
		}
		tab.setEntry(idx, next, l.extendedL2)
		if external {
			// The data file: give the space back now (a raw data file
			// must read zeros there; the entry says so too).
			if err := w.host.zeroDataFile(g*cs, cs); err != nil {
				return err
			}
		}
	}
	w.img.invalidate(off, n)
	if w.dirty.full() {
		return w.flushLocked()
	}
	return nil
}
