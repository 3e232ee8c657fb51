package qcow2

import (
	"fmt"
)

// The write side of the cluster mapping (imago's ensure_data_mapping):
// making sure a writable host cluster backs each guest cluster a write
// touches, and linking it in once its data is written.
//
// A guest cluster is written in place when its entry is a data cluster
// this image owns (COPIED, refcount 1, in an L2 table it owns too) and,
// with extended L2 entries, every subcluster the write touches is already
// allocated. Anything else needs a plan (clusterPlan): which host cluster
// takes the data (the owned one, or a fresh one, or with an external data
// file the guest offset itself), which parts of it are guest data and
// which are copied, and the entry to link. Plans are made under w.mu, their
// data written without it, and linked under it again.

// clusterPlan is what one guest cluster of a write needs.
type clusterPlan struct {
	g        int64   // guest cluster index
	entryIdx int64   // index of its entry in the L2 table
	old      l2Entry // the entry when planned
	host     int64   // host offset of the cluster the data goes to
	fresh    bool    // a new cluster: the old one's references go
	zeroed   bool    // the host cluster reads zeros where not written
	a, b     int64   // the write's bytes within the cluster: [a, b)
	// copy are the parts of the cluster outside [a, b) to fill from the
	// cluster's current content (copy-on-write), as [start, end) pairs
	// within the cluster.
	copy []clusterPart
	next l2Entry // the entry to link
}

// ownedL2 returns the L2 table of L1 entry l1i for writing, owned by this
// image (COPIED): a new zeroed table if there is none, a copy of a table
// shared with a snapshot. The caller holds w.mu.
func (w *writer) ownedL2(l1i int64) (*table, int64, error) {
	l := w.l
	t := l.l1.Load()
	if l1i >= t.len() {
		return nil, 0, fmt.Errorf("%s: L1 index %d past the L1 table (%d entries)", l.name, l1i, t.len())
	}
	e := t.entry(l1i)
	off := e.l2Offset()
	if off != 0 {
		if err := l.checkL1Entry(t, l1i); err != nil {
			return nil, 0, err
		}
	}
	if off != 0 && e.copied() {
		tab, err := w.dirty.table(off, MetaL2)
		return tab, off, err
	}
	cs := l.clusterSize()
	if off != 0 {
		// The shared table is freed once the new one is durable:
		// refuse now if that would free anything but an L2 table.
		if err := w.frees.freeable(off/cs, 1, MetaL2); err != nil {
			return nil, 0, err
		}
	}
	words := make([]uint64, cs/8)
	if off != 0 {
		// Shared with a snapshot: the copy is ours; its entries point
		// to clusters both tables now share, so none is COPIED.
		old, err := l.cache.get(cacheKey{owner: l.owner, off: off}, func() ([]uint64, error) {
			return l.meta.table(off, "L2 table")
		})
		if err != nil {
			return nil, 0, err
		}
		step := int64(l.l2EntryWords())
		for i := int64(0); i < int64(len(words)); i++ {
			words[i] = old.word(i)
			if i%step == 0 {
				words[i] &^= oflagCopied
			}
		}
	}
	noff, err := w.alloc.allocateOne()
	if err != nil {
		return nil, 0, err
	}
	if err := w.host.addMeta(noff, cs, MetaL2); err != nil {
		return nil, 0, err
	}
	tab := w.dirty.put(noff, words, MetaL2, true)
	atomicStoreL1(t, l1i, l1Entry(uint64(noff)|oflagCopied))
	w.dirty.markL1(l1i)
	if off != 0 {
		// The L1 entry stops naming the shared table once it is
		// durable: then the table counts one reference less.
		if err := w.frees.free(off/cs, 1, MetaL2); err != nil {
			return nil, 0, err
		}
	}
	return tab, noff, nil
}

// inPlace reports whether a write of [a, b) of a guest cluster with entry
// e, in a table the image owns (tableOwned), can go straight to its host
// cluster.
func (w *writer) inPlace(e l2Entry, a, b int64, tableOwned bool) bool {
	l := w.l
	if !tableOwned || e.compressed() || !e.allocated(l.external()) || !e.copied() {
		return false
	}
	if !l.extendedL2 {
		return e.word&oflagZero == 0
	}
	mask := subclusterMask(a, b, l.scBits)
	return e.bitmap&mask == mask
}

// subclusterMask is the bitmap of the subclusters [a, b) of a cluster
// touches.
func subclusterMask(a, b int64, scBits uint) uint64 {
	first, last := a>>scBits, (b-1)>>scBits
	return (uint64(1)<<(last+1) - 1) &^ (uint64(1)<<first - 1)
}

// plan works out what guest cluster g, entry e at index idx of its L2
// table, needs for a write of [a, b) of it. It allocates nothing.
func (w *writer) plan(g, idx int64, e l2Entry, a, b int64) (clusterPlan, error) {
	l := w.l
	cs := l.clusterSize()
	p := clusterPlan{g: g, entryIdx: idx, old: e, a: a, b: b}
	external := l.external()
	owned := !e.compressed() && e.allocated(external) && e.copied()
	switch {
	case external:
		// Data files hold guest cluster g at guest offset g*cs.
		p.host = g * cs
		// Past the data file's size at open it reads zeros until
		// written (grown with truncate, or never reached).
		p.zeroed = w.host.dataReadsZero(p.host) && l.crypt == nil
	case owned:
		h, err := w.dataCluster(e, g)
		if err != nil {
			return p, err
		}
		p.host = h
	default:
		p.fresh = true // host and zeroed come with the allocation
		// What it replaces is freed once the new entry is durable:
		// refuse now, before anything is written, if that would free
		// metadata.
		if first, n := w.referenced(e); n > 0 {
			if err := w.frees.freeable(first, n, 0); err != nil {
				return p, err
			}
		}
	}
	// Bytes of the last cluster past the end of the disk are never read:
	// nothing is copied there. Except in an encrypted cluster, where
	// they are written as encrypted zeros, as qemu writes them: once the
	// disk grows over them they are guest data, which must read zeros,
	// not what decrypting bytes never written gives.
	end := min(cs, l.vsize()-g*cs)
	if l.crypt != nil {
		end = cs
	}
	if !l.extendedL2 {
		// The whole cluster becomes guest data: the write, and the
		// rest as it reads now (zeros for a zero cluster).
		p.copy = appendPart(appendPart(nil, 0, a), b, end)
		p.next = l2Entry{word: uint64(p.host) | oflagCopied}
		return p, nil
	}
	// Extended L2: the touched subclusters become allocated, their
	// untouched parts copied; untouched subclusters keep what they are,
	// except that a fresh cluster replacing an old one takes a copy of
	// every subcluster that had data there.
	sc := int64(1) << l.scBits
	touched := subclusterMask(a, b, l.scBits)
	alloc, zero := e.bitmap&subclusterAllocMask, e.bitmap>>32
	if e.compressed() {
		alloc, zero = subclusterAllocMask, 0 // all data, no bitmap
	}
	copyAll := uint64(0)
	if p.fresh && (e.compressed() || e.allocated(external)) {
		copyAll = alloc &^ touched
	}
	for i := int64(0); i < subclustersPerCluster && i*sc < end; i++ {
		bit := uint64(1) << i
		s, t := i*sc, min((i+1)*sc, end)
		switch {
		case touched&bit != 0:
			p.copy = appendPart(p.copy, s, max(s, min(a, t)))
			p.copy = appendPart(p.copy, min(t, max(b, s)), t)
		case copyAll&bit != 0:
			p.copy = appendPart(p.copy, s, t)
		}
	}
	newAlloc := touched | copyAll
	if !p.fresh {
		newAlloc |= alloc
	}
	newZero := zero &^ newAlloc
	p.next = l2Entry{word: uint64(p.host) | oflagCopied, bitmap: newZero<<32 | newAlloc}
	return p, nil
}

// clusterPart is a range [start, end) of bytes within a cluster.
type clusterPart struct{ start, end int64 }

// appendPart appends [s, t) to parts, merged with the last one when they
// touch; empty parts are dropped.
func appendPart(parts []clusterPart, s, t int64) []clusterPart {
	if s >= t {
		return parts
	}
	if n := len(parts); n > 0 && parts[n-1].end == s {
		parts[n-1].end = t
		return parts
	}
	return append(parts, clusterPart{s, t})
}

// link installs the entries of plans (made for L2 table tab at index l1i,
// their data written) and schedules the release of what they replace. The
// caller holds w.mu.
func (w *writer) link(tab *table, plans []clusterPlan) error {
	l := w.l
	for i := range plans {
		p := &plans[i]
		p.next.word = p.next.word&^l2OffsetMask | uint64(p.host)&l2OffsetMask
		tab.setEntry(p.entryIdx, p.next, l.extendedL2)
		if !p.fresh {
			continue
		}
		if first, n := w.referenced(p.old); n > 0 {
			if err := w.frees.free(first, n, 0); err != nil {
				return err
			}
		}
	}
	return nil
}

// referenced returns the host clusters [first, first+n) of the image file
// that L2 entry e references: a data cluster, or those a compressed
// cluster's bytes lie in (n = 0: none, or they are in a data file).
func (w *writer) referenced(e l2Entry) (first, n int64) {
	l := w.l
	cs := l.clusterSize()
	switch {
	case e.compressed():
		off, size := e.compressedRange(l.clusterBits)
		return off / cs, (off+size-1)/cs - off/cs + 1
	case e.allocated(l.external()) && !l.external():
		return e.hostOffset() / cs, 1
	}
	return 0, 0
}

// dataCluster returns the host offset of the data cluster that entry e of
// guest cluster g names, for writing in place: it must be cluster aligned
// (qemu: "Data cluster offset ... unaligned"), or the image is corrupt
// and marked so. (The read path refuses the same entry.)
func (w *writer) dataCluster(e l2Entry, g int64) (int64, error) {
	l := w.l
	h := e.hostOffset()
	if h&(l.clusterSize()-1) == 0 || l.external() {
		return h, nil
	}
	err := &FormatError{File: l.name, Field: "L2 entry", Value: e.word, Offset: -1,
		Msg: fmt.Sprintf("data cluster offset %#x unaligned (guest offset: %#x): the image is corrupt; it is marked so and no longer written", h, g<<l.clusterBits)}
	w.host.markCorrupt(err)
	return 0, err
}
