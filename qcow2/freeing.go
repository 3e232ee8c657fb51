package qcow2

import "fmt"

// Freeing: what happens to the clusters a reference no longer names.
//
// A reference removed in memory (an L2 entry discarded, a cluster replaced
// by its copy, an L2 table by its copy) is pending until a flush has made
// its removal durable; then the clusters' refcounts drop. A cluster whose
// last reference went is quarantined until no request that could still
// map it is left (pin.go), then its range is punched, its refcount drops
// to zero and the allocator may use it again. Nothing is freed without a
// check against the metadata map first: a damaged entry must not have a
// table freed and punched.

// freeLists are the writer's references and clusters on their way to
// being free, guarded by w.mu. They drop refcounts through the allocator,
// check, punch and fail through the host door, and ask the image's pins
// when a cluster may be reused.
type freeLists struct {
	l      *layer
	alloc  *allocator
	host   *hostDoor
	pins   *pins
	behind *behind // writes in flight into clusters given back (unallocate)

	pending    []freeing
	quarantine []quarantined
}

// freeing is a reference the writer removed in memory: once that removal
// is durable, the refcounts of clusters [first, first+n) drop by one.
type freeing struct {
	first, n int64
}

// quarantined is a cluster whose last reference is gone and durable, whose
// refcount drops to zero once no pin of epoch tag is left.
type quarantined struct {
	c   int64
	tag uint64
}

// free schedules dropping one reference to clusters [first, first+n)
// once the removal of that reference (made in memory by the caller) is
// durable. kind is what the reference named: an L2 table (MetaL2), or
// guest data (0: a data or compressed cluster). The clusters must hold
// nothing else: a damaged L2 entry naming the L1 table as its data cluster
// would otherwise have the live L1 table freed and punched. An L2 table
// leaves the metadata map now: nothing writes it any more, and it is
// reused only once its refcount reaches zero.
func (fl *freeLists) free(first, n int64, kind MetaKind) error {
	cs := fl.l.clusterSize()
	if err := fl.freeable(first, n, kind); err != nil {
		return err
	}
	if kind != 0 {
		fl.host.dropMeta(first*cs, n*cs, kind)
	}
	if k := len(fl.pending); k > 0 && fl.pending[k-1].first+fl.pending[k-1].n == first {
		fl.pending[k-1].n += n
		return nil
	}
	fl.pending = append(fl.pending, freeing{first, n})
	return nil
}

// freeable checks that a reference to clusters [first, first+n), naming
// what kind says (see free), can be dropped: the clusters hold nothing
// else, and each has a refcount in a sound refcount block (one that is no
// other table too). A reference without a refcount, or whose refcount
// lives in another table, is corruption qemu-img check reports; dropping
// it would write a refcount into that table. Callers check before they
// change anything, so that a refused write or discard changes nothing.
func (fl *freeLists) freeable(first, n int64, kind MetaKind) error {
	cs := fl.l.clusterSize()
	allowed := MetaKinds(0)
	if kind == MetaL2 {
		allowed = Kinds(MetaL2, MetaSnapshotL2) // shared with a snapshot
	}
	if err := fl.host.checkClusters("freeing", first*cs, n*cs, allowed); err != nil {
		return err
	}
	for c := first; c < first+n; c++ {
		if err := fl.alloc.soundBlocks(c, c+1); err != nil {
			return err
		}
		rc, err := fl.alloc.refcount(c)
		if err != nil {
			return err
		}
		if rc == 0 {
			err := &FormatError{File: fl.l.name, Field: "refcount", Value: 0, Offset: -1,
				Msg: fmt.Sprintf("cluster %#x is referenced but has refcount 0: the image is corrupt; it is marked so and no longer written", c*cs)}
			fl.host.markCorrupt(err)
			return err
		}
	}
	return nil
}

// tableReleasable checks, before a table is replaced, that releaseTable
// will be able to give its clusters back.
func (fl *freeLists) tableReleasable(off, n int64, kind MetaKind) error {
	return fl.host.checkClusters("freeing", off, n, Kinds(kind))
}

// releaseTable gives back the clusters of a table of the given kind at
// [off, off+n) whose last reference, the header's, is durably gone (an L1
// table or refcount table replaced by a larger one): they must hold that
// table only, they leave the metadata map, and their refcounts drop.
func (fl *freeLists) releaseTable(off, n int64, kind MetaKind) error {
	if err := fl.tableReleasable(off, n, kind); err != nil {
		return err
	}
	fl.host.dropMeta(off, n, kind)
	cs := fl.l.clusterSize()
	for c := off / cs; c < (off+n+cs-1)/cs; c++ {
		if err := fl.decref(c); err != nil {
			return err
		}
	}
	return nil
}

// decref removes one reference to cluster c now: for references whose
// removal is already durable (an old refcount table).
func (fl *freeLists) decref(c int64) error {
	rc, err := fl.alloc.refcount(c)
	if err != nil || rc == 0 {
		return err
	}
	if rc == 1 {
		fl.quarantine = append(fl.quarantine, quarantined{c: c, tag: fl.pins.now()})
		return nil
	}
	return fl.alloc.setRefcount(c, rc-1)
}

// release drops the refcounts of the references the last flush made
// durably gone (flush.go, step 5: never before the removal is durable, so
// that a crash leaves a leak at worst). A cluster still referenced
// elsewhere (a snapshot) just counts one less; one whose last reference
// went is quarantined.
func (fl *freeLists) release() error {
	pending := fl.pending
	fl.pending = nil
	tag := fl.pins.now()
	for _, f := range pending {
		for c := f.first; c < f.first+f.n; c++ {
			rc, err := fl.alloc.refcount(c)
			if err != nil {
				return fl.host.fail(err)
			}
			switch {
			case rc == 0:
				// A reference without a refcount (free checked
				// when it was scheduled; a refcount block changed
				// since?): corrupt, and nothing is written.
				err := &FormatError{File: fl.l.name, Field: "refcount", Value: 0, Offset: -1,
					Msg: fmt.Sprintf("cluster %#x was referenced but has refcount 0: the image is corrupt; it is marked so and no longer written", c*fl.l.clusterSize())}
				fl.host.markCorrupt(err)
				return err
			case rc == 1:
				fl.quarantine = append(fl.quarantine, quarantined{c: c, tag: tag})
			default:
				if err := fl.alloc.setRefcount(c, rc-1); err != nil {
					return fl.host.fail(err)
				}
			}
		}
	}
	return fl.reclaim()
}

// reclaim frees the quarantined clusters no pin can see any more: their
// host range is punched (so it reads zeros; the door refuses to punch
// metadata, before anything changes), their refcount drops to zero, and
// the allocator may use them again.
func (fl *freeLists) reclaim() error {
	epoch := fl.pins.settle()
	keep := fl.quarantine[:0]
	for _, q := range fl.quarantine {
		if epoch < q.tag+2 {
			keep = append(keep, q)
			continue
		}
		// Punched first: a cluster that holds metadata is refused
		// there (the image is corrupt) before its refcount changes.
		if err := fl.host.punch(q.c); err != nil {
			return err
		}
		if err := fl.alloc.setRefcount(q.c, 0); err != nil {
			return fl.host.fail(err)
		}
		fl.alloc.released(q.c)
	}
	fl.quarantine = keep
	return nil
}

// unallocate gives back the fresh clusters of plans that were never
// linked: nothing references them, so they are quarantined at once, once
// any write of theirs in flight has landed, and reused like freed ones.
func (fl *freeLists) unallocate(plans []clusterPlan) {
	cs := fl.l.clusterSize()
	tag := fl.pins.now()
	for _, pl := range plans {
		if pl.fresh {
			fl.behind.wait(pl.host, pl.host+cs)
			fl.quarantine = append(fl.quarantine, quarantined{c: pl.host / cs, tag: tag})
		}
	}
}

// empty reports whether nothing is on its way to being free.
func (fl *freeLists) empty() bool { return len(fl.pending) == 0 && len(fl.quarantine) == 0 }
