package fs

import (
	"sync"
	"sync/atomic"
	"weak"
)

// Views of a disk's bytes, kept coherent.
//
// A writable disk shows its bytes through several files: the disk's raw
// file, one file per partition (parts.go), a node of the disk replaced
// after a write past its end (writeback.go), and whatever view is added
// later (a guest's files, say). The kernel caches each file in pages of
// its own and knows nothing of their sharing bytes, so a byte written
// through one file is stale in the others' pages, and a page of one file
// written back later puts old bytes over newer ones written through
// another. Every such file joins its disk's viewSet (a view, below), and
// the set keeps them coherent: a write, zero-write, discard or grow
// through one view is visible through the others once it is answered, and
// no cached page of one view is written back over newer bytes written
// through another.
//
// What the set does, with the one tool a FUSE daemon has over the kernel's
// caches (FUSE_NOTIFY_INVAL_INODE, which writes a range's dirty pages back
// through the daemon, then drops its pages):
//
//   - After bytes change through one view, every other view that may hold
//     pages of them drops those pages (wrote). Whether a view may hold
//     pages is known: pages come from reads through the page cache and from
//     handles opened with it (mayCache). A view nothing has cached costs
//     nothing, so a disk used through one file at a time pays a few loads
//     per request.
//   - Pages written through a view's page cache with the writeback cache
//     stay in the kernel until it writes them back, out of the daemon's
//     sight. While two views are open and one of them for writing, the
//     handles opened later bypass the page cache (open: FOPEN_DIRECT_IO),
//     so that at most one view, the first opened, has a page cache that
//     may be written to; every direct read or write through another view
//     first has that view write back its dirty pages of the range
//     (reading, writing), so that it reads them, or so that they land
//     before the newer bytes, not after.
//   - After the disk grew through one view, every other view of its end
//     (another node of the whole disk) drops its attributes (grew).
//
// Deadlocks. A notification waits for the kernel: for the pages of the
// range to be unlocked and their writebacks answered, and for the dirty
// ones to be written back, which are WRITE requests the daemon must
// answer meanwhile (and which the kernel sends in the background, at most
// MaxBackground at once). A request that holds pages of its own while it
// waits for a notification can therefore wait, through the kernel, for
// itself. The rules, by kind of request (ioKind):
//
//   - A page-cache request (cachedIO: readahead, a page fault, the
//     writeback of a dirty page) holds its pages until it is answered and
//     takes a background slot. It never waits for a notification to
//     another view, with one exception: a page fault through a direct
//     view (writeback cache only) has the writable cached view write back
//     first (that view's own requests never wait, so this ends), at most
//     faultWaits of them at once, so that writebacks always find a
//     background slot; the others go ahead without. A page-cache write's
//     notifications to the other views are queued (enqueue), and sent by a
//     goroutine of the set's; fsync, close (FLUSH), open and every direct
//     request wait for the queue (barrier), so that the write is visible
//     through the other views by the time it is acknowledged to anyone.
//   - A direct request (directIO: a read or write of a handle without the
//     page cache, or with O_DIRECT) holds no pages and takes no background
//     slot (go-fuse does not ask for FUSE_ASYNC_DIO): it waits for its
//     notifications, which wait only for page-cache requests. So do
//     fallocate, fsync and close, which hold no pages either.
//   - A write through the page cache without the writeback cache
//     (throughIO) holds its pages locked and waits for its notifications.
//     Only the one writable cached view sends such writes, and without the
//     writeback cache no page fault waits for anything, so nothing holding
//     another view's pages waits for it.
//   - No notification goes to the view of the request itself (the kernel
//     keeps its own file coherent, and holds locks of it over some
//     requests: a truncate's, for one).
//
// What is left to the kernel, and said in docs/design.md: mapped pages of
// two views written at once (two page caches dirty over the same bytes,
// the later writeback wins per page); a loop device's own block-device
// cache, which no notification reaches.

// A view is a file whose bytes are some of a disk's bytes.
type view interface {
	// overlaps reports whether the view shows any of the disk's bytes
	// [off, off+n).
	overlaps(off, n int64) bool
	// drop has the kernel drop its cached pages of the view that hold
	// any of the disk's bytes [off, off+n), all of them if n < 0,
	// writing dirty pages back through the daemon first.
	drop(off, n int64)
}

// ioKind is how the kernel sent a READ or WRITE (requestKinds).
type ioKind uint8

const (
	// cachedIO: the page cache reading pages in or writing them back.
	cachedIO ioKind = iota
	// directIO: a read or write that bypasses the page cache.
	directIO
	// throughIO: a write(2) through the page cache, without the
	// writeback cache; or a direct write from the kernel itself (a loop
	// device's), which the kernel does not mark.
	throughIO
)

// faultWaits bounds the page faults of direct views waiting for a
// writeback at once: well under MaxBackground, so that writebacks get a
// background slot while they wait.
const faultWaits = 16

// views is the mount's registry of view sets, one per disk.
type views struct {
	mu        sync.Mutex
	sets      map[diskID]weak.Pointer[viewSet] // a set lives while a member does
	swept     int                              // len(sets) after the last sweep
	writeback bool                             // the mount has the writeback cache
	faults    chan struct{}                    // tokens: faultWaits of them
}

func newViews(writeback bool) *views {
	return &views{sets: map[diskID]weak.Pointer[viewSet]{}, writeback: writeback, faults: make(chan struct{}, faultWaits)}
}

// join makes v a view of disk d (a whole disk, diskID.base) and returns
// its membership, which lasts as long as the member is reachable: a
// node's, until the kernel forgets the node and go-fuse lets go of it.
func (r *views) join(d diskID, v view) *viewMember {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.sets[d].Value()
	if s == nil {
		s = &viewSet{writeback: r.writeback, faults: r.faults}
		s.qcond = sync.NewCond(&s.qmu)
		r.sets[d] = weak.Make(s)
		if len(r.sets) > 2*r.swept+64 {
			for k, p := range r.sets {
				if p.Value() == nil {
					delete(r.sets, k)
				}
			}
			r.swept = len(r.sets)
		}
	}
	return s.join(v)
}

// join makes v a member of s.
func (s *viewSet) join(v view) *viewMember {
	vm := &viewMember{set: s, v: v}
	s.mu.Lock()
	s.members = append(s.members, weak.Make(vm))
	s.mu.Unlock()
	return vm
}

// viewSet is the views of one disk. mu guards the members and their
// counts; qmu the queue of notifications.
type viewSet struct {
	writeback bool
	faults    chan struct{}

	mu      sync.Mutex
	members []weak.Pointer[viewMember]

	// The members' writers, and the members that may hold pages,
	// counted (changed under mu, read without it): a request through
	// the only view that writes or caches looks no further. A member
	// gone is counted out when others finds it gone.
	writers, caching atomic.Int32

	qmu      sync.Mutex
	qcond    *sync.Cond
	queue    []dropping
	queued   uint64 // notifications queued so far
	done     uint64 // and sent
	draining bool   // a goroutine sends them
}

// dropping is a notification to send: the view drops its pages of the
// disk's bytes [off, off+n).
type dropping struct {
	to     *viewMember
	off, n int64
}

// viewMember is one view in its set.
type viewMember struct {
	set *viewSet
	v   view

	// Guarded by set.mu: handles open, and of them with the page cache
	// for writing; writers (for writing) is changed under it too.
	handles, cachedWriters int
	writers                atomic.Int32

	// mayCache: the kernel may hold pages of the view (a handle with
	// the page cache was opened, or a page-cache request served);
	// changed under set.mu, counted in set.caching.
	mayCache atomic.Bool
}

// setMayCache sets or clears mayCache, keeping set.caching; under set.mu.
func (vm *viewMember) setMayCache(on bool) {
	if vm.mayCache.Load() != on {
		vm.mayCache.Store(on)
		if on {
			vm.set.caching.Add(1)
		} else {
			vm.set.caching.Add(-1)
		}
	}
}

// othersWrite reports whether another view may have a writable handle.
func (vm *viewMember) othersWrite() bool { return vm.set.writers.Load() > vm.writers.Load() }

// othersCache reports whether another view may hold pages.
func (vm *viewMember) othersCache() bool {
	mine := int32(0)
	if vm.mayCache.Load() {
		mine = 1
	}
	return vm.set.caching.Load() > mine
}

// others calls f for every live member of the set but vm, under s.mu,
// and drops the members that are gone (counting them out of caching: a
// member with handles, hence writers, is never gone).
func (vm *viewMember) others(f func(o *viewMember)) {
	s := vm.set
	live := s.members[:0]
	caching := int32(0)
	for _, p := range s.members {
		o := p.Value()
		if o == nil {
			continue
		}
		live = append(live, p)
		if o.mayCache.Load() {
			caching++
		}
		if o != vm {
			f(o)
		}
	}
	if len(live) < len(s.members) {
		clear(s.members[len(live):])
		s.members = live
		s.caching.Store(caching)
	}
}

// open counts a handle of the view opened for writing or not, and says
// whether it may use the page cache: unless, for a handle opened for
// writing, another view has a handle open, or for one opened for reading,
// another view has a writable handle with the page cache. direct says
// whether a handle may do without it (with the writeback cache, only on
// kernels that write a range's dirty pages back before a direct write of
// it: Root.KernelFlags); if not, every handle uses it.
func (vm *viewMember) open(write, direct bool) (cached bool) {
	if vm == nil {
		return true
	}
	s := vm.set
	s.mu.Lock()
	defer s.mu.Unlock()
	cached = true
	if direct {
		vm.others(func(o *viewMember) {
			if write && o.handles > 0 || o.cachedWriters > 0 {
				cached = false
			}
		})
	}
	vm.handles++
	if write {
		vm.writers.Add(1)
		s.writers.Add(1)
		if cached {
			vm.cachedWriters++
		}
	}
	if cached {
		vm.setMayCache(true)
	}
	return cached
}

// release counts a handle (as open answered) closed.
func (vm *viewMember) release(write, cached bool) {
	if vm == nil {
		return
	}
	s := vm.set
	s.mu.Lock()
	defer s.mu.Unlock()
	vm.handles--
	if write {
		vm.writers.Add(-1)
		s.writers.Add(-1)
		if cached {
			vm.cachedWriters--
		}
	}
}

// cached notes that a page-cache request was served through the view.
func (vm *viewMember) cached() {
	if vm != nil && !vm.mayCache.Load() {
		vm.set.mu.Lock()
		vm.setMayCache(true)
		vm.set.mu.Unlock()
	}
}

// reading is called before a read of kind k, through a handle with the
// page cache or not, of the disk's bytes [off, off+n) through the view:
// a view that may hold dirty pages of them (one with a writable handle)
// writes them back first, so that the read finds them. A read through
// the page cache of a handle that has it reads what the kernel holds of
// its own view, which is the only one written through a page cache while
// another view is open (see above): it waits for nothing. A page fault
// through a direct handle waits for the writable cached view only, and
// only with the writeback cache (see above).
func (vm *viewMember) reading(off, n int64, k ioKind, handleCached bool) {
	switch {
	case vm == nil:
	case k != cachedIO:
		vm.flush(off, n, k, false)
	case !handleCached && vm.set.writeback:
		vm.flush(off, n, k, true)
	}
}

// writing is called before a write of kind k (a zero-write or discard is
// a directIO one) changes the disk's bytes [off, off+n) through the view:
// a view that may hold dirty pages of them writes them back first, so
// that they land before the newer bytes, not after. A page-cache write
// waits for nothing.
func (vm *viewMember) writing(off, n int64, k ioKind) {
	if vm != nil && k != cachedIO {
		vm.flush(off, n, k, false)
	}
}

// flush has every other view with a writable handle (only the writable
// cached one, for a page fault) write back its dirty pages of the disk's
// bytes [off, off+n).
func (vm *viewMember) flush(off, n int64, k ioKind, fault bool) {
	if !vm.othersWrite() {
		return
	}
	s := vm.set
	var flush []*viewMember
	s.mu.Lock()
	vm.others(func(o *viewMember) {
		if o.writers.Load() > 0 && (!fault || o.cachedWriters > 0) && o.v.overlaps(off, n) {
			flush = append(flush, o)
		}
	})
	s.mu.Unlock()
	if len(flush) == 0 {
		return
	}
	if fault {
		select {
		case s.faults <- struct{}{}:
			defer func() { <-s.faults }()
		default:
			return // see faultWaits
		}
	}
	for _, o := range flush {
		o.v.drop(off, n)
	}
	if k == directIO {
		// The writebacks queued notifications to the other views (this
		// one's mapped pages among them).
		s.barrier()
	}
}

// wrote is called once a write of kind k changed the disk's bytes
// [off, off+n) through the view: every other view that may hold pages of
// them drops them, at once, or for a page-cache write through the queue.
// A view with no handle open drops all its pages, and is then known to
// hold none until it is opened again.
func (vm *viewMember) wrote(off, n int64, k ioKind) {
	if vm == nil {
		return
	}
	if k != directIO {
		vm.cached() // the written pages are in the view's cache
	}
	if !vm.othersCache() {
		return
	}
	s := vm.set
	var drops []dropping
	s.mu.Lock()
	vm.others(func(o *viewMember) {
		if !o.mayCache.Load() || !o.v.overlaps(off, n) {
			return
		}
		d := dropping{to: o, off: off, n: n}
		if o.handles == 0 {
			o.setMayCache(false)
			d.n = -1
		}
		drops = append(drops, d)
	})
	s.mu.Unlock()
	if len(drops) == 0 {
		return
	}
	if k == cachedIO {
		s.enqueue(drops)
		return
	}
	for _, d := range drops {
		d.to.v.drop(d.off, d.n)
	}
}

// grew is called once the disk grew from old to size bytes through the
// view: every other view of the new bytes (another node of the whole disk)
// drops its attributes, and the size with them, at once. (With the
// writeback cache the kernel keeps a node's size while the node is open,
// whatever the daemon says: writeback.go.)
func (vm *viewMember) grew(old, size int64) {
	if vm == nil {
		return
	}
	s := vm.set
	var grown []*viewMember
	s.mu.Lock()
	vm.others(func(o *viewMember) {
		if o.v.overlaps(old, size-old) {
			grown = append(grown, o)
		}
	})
	s.mu.Unlock()
	for _, o := range grown {
		o.v.drop(old, size-old)
	}
}

// enqueue queues notifications, to be sent by the set's goroutine.
func (s *viewSet) enqueue(drops []dropping) {
	s.qmu.Lock()
	defer s.qmu.Unlock()
	s.queue = append(s.queue, drops...)
	s.queued += uint64(len(drops))
	if !s.draining {
		s.draining = true
		go s.drain()
	}
}

// drain sends the queued notifications, in order, until none is left.
func (s *viewSet) drain() {
	s.qmu.Lock()
	for len(s.queue) > 0 {
		batch := s.queue
		s.queue = nil
		s.qmu.Unlock()
		for _, d := range batch {
			d.to.v.drop(d.off, d.n)
		}
		s.qmu.Lock()
		s.done += uint64(len(batch))
		s.qcond.Broadcast()
	}
	s.draining = false
	s.qmu.Unlock()
}

// barrier waits until the notifications queued so far for the view's set
// are sent. Only requests that hold no pages may call it (see above).
func (vm *viewMember) barrier() {
	if vm != nil {
		vm.set.barrier()
	}
}

func (s *viewSet) barrier() {
	s.qmu.Lock()
	defer s.qmu.Unlock()
	for target := s.queued; s.done < target; {
		s.qcond.Wait()
	}
}
