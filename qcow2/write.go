package qcow2

import (
	"fmt"
	"sync"
)

// Writing guest data, zeroing and discarding, resizing.
//
// A write goes through the writer in runs of guest clusters, each inside
// one L2 table: a run of clusters writable in place is written straight to
// its host clusters, without the writer's mutex (its pin keeps those
// clusters from being reused meanwhile); a run that needs metadata holds
// its guest range (guestHolds), is planned and allocated under w.mu,
// written without it, and linked under it again (writemap.go, cow.go).

// guestRange is a range [start, end) of guest bytes.
type guestRange struct{ start, end int64 }

// guestHolds are the guest ranges held by writes that change metadata
// (allocRun, zeroClusters): overlapping ones wait for each other, as
// qemu's allocations do. Guarded by w.mu.
type guestHolds struct {
	cond   *sync.Cond // waits for a range held by another write
	ranges []guestRange
}

// newGuestHolds returns the holds of a writer whose mutex is mu.
func newGuestHolds(mu *sync.Mutex) guestHolds { return guestHolds{cond: sync.NewCond(mu)} }

// maxRunBytes bounds one run of a write, so that a large write does not
// hold a long guest range (or allocate) all at once.
const maxRunBytes = 4 << 20

// WriteAt writes p at guest offset off. A write past the end of the disk
// writes what fits and fails with ErrNoSpace.
func (img *Image) WriteAt(p []byte, off int64) (int, error) {
	w := img.w
	if w == nil {
		return 0, img.readOnly()
	}
	size := img.Size()
	if off < 0 || off > size {
		return 0, fmt.Errorf("%s: write at %d: %w (%d bytes)", img.top.name, off, ErrNoSpace, size)
	}
	want := len(p)
	if int64(len(p)) > size-off {
		p = p[:size-off]
	}
	w.st.writes.Add(1)
	if err := w.start(off, int64(len(p))); err != nil {
		return 0, err
	}
	var done int
	var err error
	if w.l.crypt != nil {
		done, err = w.writeSectors(p, off)
	} else {
		done, err = w.writeRuns(p, off)
	}
	if err != nil {
		return done, err
	}
	if done < want {
		return done, fmt.Errorf("%s: write of %d bytes at %d: %w (%d bytes)", img.top.name, want, off, ErrNoSpace, size)
	}
	return done, nil
}

func (img *Image) readOnly() error {
	reason := img.roReason
	if reason == "" {
		reason = "not opened for writing"
	}
	return &ReadOnlyError{File: img.top.name, Reason: reason}
}

// start checks that writes may go on, and before the first one clears
// the autoclear bits the writer does not maintain (as the specification
// asks of a program that does not understand them) and sets the enabled
// bitmaps in_use. Then it sets their bits for the guest range [off,
// off+n) about to change (n 0: none), under w.mu, so that a resize
// (growBitmaps, which replaces the bits) cannot lose them. Until the
// first start succeeds, every start tries again: one that failed (a full
// host disk) must not let the next write go ahead without in_use.
func (w *writer) start(off, n int64) error {
	if err := w.host.usable(); err != nil {
		return err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.modified = true
	if !w.headerCleaned {
		if err := w.cleanHeader(); err != nil {
			return err
		}
		w.headerCleaned = true
	}
	w.mark(off, n)
	return nil
}

// cleanHeader prepares the image for its first write (start). The caller
// holds w.mu.
func (w *writer) cleanHeader() error {
	// The last cluster in use may end past the end of the file (qemu
	// leaves it cut short): the file covers it from now on, so that what
	// is written in place there reads back (reads clip at the file's
	// end). (Not further: refcounts past that are a damaged image's.)
	// Likewise a data file covers the whole disk.
	cs := w.l.clusterSize()
	if err := w.host.reserveFile(min(w.alloc.inUseEnd()*cs, (w.l.fsize()+cs-1)&^(cs-1))); err != nil {
		return err
	}
	if err := w.host.growDataFile(); err != nil {
		return err
	}
	if w.l.hdr.Version < 3 {
		return nil
	}
	auto := w.host.headerField(fieldAutoclearFeatures)
	keep := auto & AutoclearDataFileRaw
	if w.bitmaps.dir != nil {
		keep |= auto & AutoclearBitmaps // kept true (bitmapwrite.go)
	}
	if keep != auto {
		if err := w.host.updateHeader(func(h []byte) { fieldAutoclearFeatures.put(h, keep) }); err != nil {
			return err
		}
	}
	// The enabled bitmaps are in_use, durably, before any guest data is
	// written.
	return w.setInUse(true)
}

// writeRuns writes p at off, run by run.
func (w *writer) writeRuns(p []byte, off int64) (int, error) {
	done := 0
	for done < len(p) {
		n, err := w.writeRun(p[done:], off+int64(done))
		done += n
		if err != nil {
			return done, err
		}
	}
	return done, nil
}

// writeRun writes a prefix of p at off, within one L2 table and at most
// maxRunBytes, and returns how much it wrote.
func (w *writer) writeRun(p []byte, off int64) (int, error) {
	l := w.l
	cs := l.clusterSize()
	l2Span := cs << l.l2Bits
	n := min(int64(len(p)), l2Span-off&(l2Span-1), max(maxRunBytes, cs))
	p = p[:n]

	// In place: no metadata lock, the pin holds the host clusters, and
	// the guest range is held against readers (sector atomicity).
	pin := w.img.pins.take()
	w.sectors.lock(off, off+n)
	k, host, err := w.inPlaceRun(off, n)
	if err == nil && k > 0 {
		err = w.host.writeData(p[:k], host, pin)
		w.sectors.unlock(off, off+n, true)
		pin.Release()
		if err != nil {
			return 0, err
		}
		w.st.inPlace.Add(1)
		w.addHostBytes(k, 0)
		return int(k), nil
	}
	w.sectors.unlock(off, off+n, true)
	pin.Release()
	if err != nil {
		return 0, err
	}
	return w.allocRun(p, off)
}

// inPlaceRun returns how much of [off, off+n) (one L2 table) can be
// written in place, from off, and where it goes on the host.
func (w *writer) inPlaceRun(off, n int64) (int64, int64, error) {
	l := w.l
	cs := l.clusterSize()
	l1i := off >> (l.clusterBits + l.l2Bits)
	t := l.l1.Load()
	if l1i >= t.len() || !t.entry(l1i).copied() {
		return 0, 0, nil
	}
	tab, _, err := l.l2Table(l1i)
	if err != nil || tab == nil {
		return 0, 0, err
	}
	var done, host int64
	for pos := off; pos < off+n; {
		idx := (pos >> l.clusterBits) & (1<<l.l2Bits - 1)
		e := tab.entry(idx, l.extendedL2)
		a := pos & (cs - 1)
		b := min(cs, a+off+n-pos)
		if !w.inPlace(e, a, b, true) {
			break
		}
		h, err := w.dataCluster(e, pos>>l.clusterBits)
		if err != nil {
			return 0, 0, err
		}
		if h += a; done > 0 && h != host+done {
			break
		}
		if done == 0 {
			host = h
		}
		done += b - a
		pos += b - a
	}
	return done, host, nil
}

// allocRun writes a prefix of p at off that needs metadata: the clusters
// from off up to the first one writable in place.
func (w *writer) allocRun(p []byte, off int64) (int, error) {
	l := w.l
	cs := l.clusterSize()
	first, last := off/cs, (off+int64(len(p))-1)/cs
	w.mu.Lock()
	defer w.mu.Unlock()
	w.holds.hold(first*cs, (last+1)*cs)
	defer w.holds.unhold(first*cs, (last+1)*cs)
	if err := w.host.usable(); err != nil {
		return 0, err
	}

	l1i := off >> (l.clusterBits + l.l2Bits)
	tab, _, err := w.ownedL2(l1i)
	if err != nil {
		return 0, err
	}
	var plans []clusterPlan
	fresh := int64(0)
	end := off + int64(len(p))
	for g := first; g <= last; g++ {
		a := max(off, g*cs) - g*cs
		b := min(end, (g+1)*cs) - g*cs
		idx := g & (1<<l.l2Bits - 1)
		e := tab.entry(idx, l.extendedL2)
		if w.inPlace(e, a, b, true) {
			break
		}
		pl, err := w.plan(g, idx, e, a, b)
		if err != nil {
			return 0, err
		}
		if pl.fresh {
			fresh++
		}
		plans = append(plans, pl)
	}
	if len(plans) == 0 {
		// It became writable in place meanwhile: the caller's next
		// round writes it.
		return 0, nil
	}
	if fresh > 0 {
		runs, err := w.alloc.allocate(fresh)
		if err != nil {
			return 0, err
		}
		for i := range plans {
			if pl := &plans[i]; pl.fresh {
				host := runs[0].start
				if runs[0].start += cs; runs[0].start == runs[0].end {
					runs = runs[1:]
				}
				// (A host range that reads zeros is no zero data in an
				// encrypted image: nothing is skipped there.)
				pl.host, pl.zeroed = host, w.host.clusterReadsZero(host/cs) && l.crypt == nil
			}
		}
	}
	written := min(int64(len(p)), (plans[len(plans)-1].g+1)*cs-off)

	// The data, without mu: the guest range stays held.
	w.mu.Unlock()
	pin := w.img.pins.take()
	err = w.writePlans(plans, p[:written], off, pin)
	pin.Release()
	w.mu.Lock()
	if err != nil {
		// (A copy-on-write part that cannot be read, say.) The fresh
		// clusters were never linked: they go back, not leak.
		w.frees.unallocate(plans)
		return 0, err
	}
	// Linked into the table ownedL2 returned: the writer owns it, and
	// it stays pinned while dirty.
	tab, _, err = w.ownedL2(l1i)
	if err != nil {
		return 0, err
	}
	if err := w.link(tab, plans); err != nil {
		return 0, err
	}
	if l.external() {
		end := int64(0)
		for _, pl := range plans {
			end = max(end, pl.host+min(cs, l.vsize()-pl.g*cs))
		}
		w.host.dataWritten(end)
	}
	w.img.invalidate(off, written)
	if w.dirty.full() {
		if err := w.flushLocked(); err != nil {
			return int(written), err
		}
	}
	return int(written), nil
}

// hold waits until no other operation holds any of guest range
// [start, end), then holds it. The caller holds w.mu (the cond's lock).
func (h *guestHolds) hold(start, end int64) {
	for {
		free := true
		for _, s := range h.ranges {
			if s.start < end && start < s.end {
				free = false
				break
			}
		}
		if free {
			h.ranges = append(h.ranges, guestRange{start, end})
			return
		}
		h.cond.Wait()
	}
}

// unhold releases a range hold took. The caller holds w.mu.
func (h *guestHolds) unhold(start, end int64) {
	for i, s := range h.ranges {
		if s.start == start && s.end == end {
			h.ranges[i] = h.ranges[len(h.ranges)-1]
			h.ranges = h.ranges[:len(h.ranges)-1]
			break
		}
	}
	h.cond.Broadcast()
}

// invalidate drops what the image built from the content of guest range
// [off, off+n): the hole index chunks it touches.
func (img *Image) invalidate(off, n int64) {
	x := img.idx.Load()
	if x == nil || n <= 0 {
		return
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	for c := off >> x.chunkBits; c <= (off+n-1)>>x.chunkBits; c++ {
		if e := x.chunks[c]; e != nil {
			delete(x.chunks, c)
			x.ring.removeIf(func(r *chunkRuns) bool { return r == e }, func(*chunkRuns) {})
		}
	}
}

// Resize grows the virtual disk to size bytes (a multiple of 512); the new
// part reads as zeros. Shrinking is refused and changes nothing. In this
// order, each step durable before the next:
//
//  1. everything dirty is flushed;
//  2. the bitmaps' tables grow to cover the new size (growBitmaps);
//  3. if the L1 table is too small: the old one is checked to be
//     releasable (else the image is corrupt, and nothing of the move is
//     written), a larger one is allocated past the clusters in use and
//     written, and its refcounts made durable with the refcount table
//     entries naming new blocks (persistRefcounts);
//  4. the header is switched to the new size (and table) with one synced
//     write of its first sector (updateHeader);
//  5. an external data file grows to the new size, and only then is the
//     old L1 table given back.
func (img *Image) Resize(size int64) error {
	w := img.w
	if w == nil {
		return img.readOnly()
	}
	l := w.l
	old := img.Size()
	switch {
	case size == old:
		return nil
	case size < old:
		return fmt.Errorf("%s: shrinking from %d to %d bytes is not supported: %w", l.name, old, size, ErrReadOnly)
	case size%512 != 0:
		return fmt.Errorf("%s: the size must be a multiple of 512, not %d", l.name, size)
	case size > 1<<62:
		return fmt.Errorf("%s: size %d too large", l.name, size)
	}
	if err := w.start(0, 0); err != nil {
		return err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if err := w.flushLocked(); err != nil {
		return err
	}
	cs := l.clusterSize()
	l1Span := cs << l.l2Bits
	need := (size + l1Span - 1) / l1Span
	if need*8 > maxL1Bytes {
		return fmt.Errorf("%s: size %d needs an L1 table of %d entries, more than qemu allows", l.name, size, need)
	}
	// The bitmaps cover the new size before the header says it (a
	// disabled bitmap's table must, for qemu to open the image).
	if err := w.growBitmaps(size); err != nil {
		return err
	}
	t := l.l1.Load()
	if need <= t.len() {
		if err := w.host.updateHeader(func(h []byte) { fieldSize.put(h, uint64(size)) }); err != nil {
			return err
		}
		l.virtSize.Store(size)
		return w.host.growDataFile()
	}
	// A new L1 table, all entries of the old one and zeros. The old one
	// is given back once the header names the new one: check first that
	// it can be.
	oldOff, oldLen := t.off, (t.len()*8+cs-1)/cs*cs
	if err := w.frees.tableReleasable(oldOff, oldLen, MetaL1); err != nil {
		return err
	}
	clusters := (need*8 + cs - 1) / cs
	off, err := w.alloc.allocateTable(clusters)
	if err != nil {
		return err
	}
	entries := make([]uint64, clusters*cs/8)
	for i := int64(0); i < t.len(); i++ {
		entries[i] = uint64(t.entry(i))
	}
	buf := make([]byte, len(entries)*8)
	encodeWords(buf, entries)
	if err := w.host.addMeta(off, clusters*cs, MetaL1); err != nil {
		return err
	}
	if err := w.host.writeMeta(buf, off, MetaL1); err != nil {
		return err
	}
	// The new table and its refcounts, with the refcount table entries
	// naming their blocks, are durable before the header names it.
	if err := w.persistRefcounts(); err != nil {
		return err
	}
	// The header as it is now: allocating the table may have grown the
	// refcount table, which switched the header already.
	if err := w.host.updateHeader(func(h []byte) {
		fieldSize.put(h, uint64(size))
		fieldL1Size.put(h, uint64(need))
		fieldL1TableOffset.put(h, uint64(off))
	}); err != nil {
		return err
	}
	l.l1.Store(&l1Table{off: off, entries: entries[:need]})
	l.virtSize.Store(size)
	if err := w.host.growDataFile(); err != nil {
		return err
	}
	// The header names the new table: the old one's clusters are free.
	if err := w.frees.releaseTable(oldOff, oldLen, MetaL1); err != nil {
		return err
	}
	return w.frees.reclaim()
}
