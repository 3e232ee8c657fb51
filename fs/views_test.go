package fs

import (
	"fmt"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// fakeView is a view of the disk's bytes [start, end) that records the
// notifications it gets, in disk offsets. A notification may be held up
// (hold), as the kernel holds one while it waits for pages.
type fakeView struct {
	name       string
	start, end int64

	mu    sync.Mutex
	drops []string
	hold  chan struct{} // if set, drop waits for it to close
	done  int           // drops returned
}

func (f *fakeView) overlaps(off, n int64) bool {
	return (n < 0 || off < f.end) && off+n > f.start
}

func (f *fakeView) drop(off, n int64) {
	f.mu.Lock()
	f.drops = append(f.drops, fmt.Sprintf("%d+%d", off, n))
	hold := f.hold
	f.mu.Unlock()
	if hold != nil {
		<-hold
	}
	f.mu.Lock()
	f.done++
	f.mu.Unlock()
}

// got returns the notifications so far and forgets them.
func (f *fakeView) got() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	d := f.drops
	f.drops = nil
	return d
}

// testDisk is a disk of 8 MiB with two partitions, its three views
// joined to one set.
type testDisk struct {
	raw, p1, p2    *fakeView
	vRaw, vP1, vP2 *viewMember
	all            []*fakeView
}

func newTestDisk(writeback bool) *testDisk {
	r := newViews(writeback)
	d := diskID{key: fileKey{1, 2}, gen: 1}
	t := &testDisk{
		raw: &fakeView{name: "raw", start: 0, end: 1 << 62},
		p1:  &fakeView{name: "p1", start: 1 << 20, end: 4 << 20},
		p2:  &fakeView{name: "p2", start: 4<<20 + 1536, end: 7 << 20},
	}
	t.vRaw, t.vP1, t.vP2 = r.join(d, t.raw), r.join(d, t.p1), r.join(d, t.p2)
	t.all = []*fakeView{t.raw, t.p1, t.p2}
	return t
}

// notified returns what each view was told since the last call, by name.
func (t *testDisk) notified() map[string][]string {
	out := map[string][]string{}
	for _, v := range t.all {
		if d := v.got(); len(d) > 0 {
			out[v.name] = d
		}
	}
	return out
}

func sameDrops(a, b map[string][]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if !slices.Equal(v, b[k]) {
			return false
		}
	}
	return true
}

// TestViewOpenModes: which handles get the page cache. The first view
// opened does, and any view opened while no other is open; a handle opened
// for writing while another view is open does not, nor one opened for
// reading while another view has a writable handle with the page cache;
// the handles of the view that has them always do. Where the kernel cannot
// do without (direct false), every handle uses the page cache.
func TestViewOpenModes(t *testing.T) {
	type open struct {
		view   string
		write  bool
		cached bool // what open must answer
		close  bool // close it right after
	}
	cases := []struct {
		name   string
		direct bool
		opens  []open
	}{
		{"one view at a time", true, []open{
			{view: "raw", write: true, cached: true, close: true},
			{view: "p1", write: true, cached: true, close: true},
			{view: "p2", write: false, cached: true},
		}},
		{"a second view while one writes", true, []open{
			{view: "raw", write: true, cached: true},
			{view: "p1", write: false, cached: false},
			{view: "p1", write: true, cached: false},
			{view: "raw", write: false, cached: true},
			{view: "raw", write: true, cached: false}, // p1 is open
		}},
		{"readers share, a writer goes without", true, []open{
			{view: "raw", cached: true},
			{view: "p1", cached: true},
			{view: "p2", write: true, cached: false},
			{view: "raw", cached: true}, // no view writes through its cache
		}},
		{"the writer closed", true, []open{
			{view: "raw", write: true, cached: true, close: true},
			{view: "p1", cached: true},
		}},
		{"no direct handles on this kernel", false, []open{
			{view: "raw", write: true, cached: true},
			{view: "p1", write: true, cached: true},
			{view: "p2", cached: true},
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := newTestDisk(true)
			member := map[string]*viewMember{"raw": d.vRaw, "p1": d.vP1, "p2": d.vP2}
			for i, o := range c.opens {
				vm := member[o.view]
				if got := vm.open(o.write, c.direct); got != o.cached {
					t.Errorf("open %d (%s, write %v): cached %v, want %v", i, o.view, o.write, got, o.cached)
				}
				if o.close {
					vm.release(o.write, o.cached)
				}
			}
			runtime.KeepAlive(d)
		})
	}
}

// TestViewFlushes: who writes back before a read or write through a view.
// A direct read or write, a zero-write or a discard (directIO), or a write
// through the page cache without the writeback cache (throughIO) has every
// other view with a writable handle write back its pages of the range, in
// its own offsets (a partition is told only of its part); a page fault
// through a direct handle, with the writeback cache, only the writable
// view with the page cache; a read through the page cache of a cached
// handle, a fault without the writeback cache, and a page-cache write
// flush nothing. The view itself is never told.
func TestViewFlushes(t *testing.T) {
	const off, n = 2<<20 - 4096, 8192 // across p1 only
	for _, c := range []struct {
		name      string
		writeback bool
		read      bool
		kind      ioKind
		cached    bool // the handle's
		want      map[string][]string
	}{
		{"direct read", true, true, directIO, false, map[string][]string{"raw": {"2093056+8192"}, "p1": {"2093056+8192"}}},
		{"direct write", true, false, directIO, false, map[string][]string{"raw": {"2093056+8192"}, "p1": {"2093056+8192"}}},
		{"write-through write", false, false, throughIO, true, map[string][]string{"raw": {"2093056+8192"}, "p1": {"2093056+8192"}}},
		{"fault through a direct handle", true, true, cachedIO, false, map[string][]string{"raw": {"2093056+8192"}}},
		{"fault without the writeback cache", false, true, cachedIO, false, nil},
		{"page-cache read", true, true, cachedIO, true, nil},
		{"page-cache write", true, false, cachedIO, true, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := newTestDisk(c.writeback)
			// raw writes through its page cache, p1 without, p2 reads;
			// the request comes through another view of raw's bytes: a
			// fourth, a node of the disk replaced (writeback.go).
			d.vRaw.open(true, true)
			d.vP1.open(true, true)
			d.vP2.open(false, true)
			other := &fakeView{name: "raw2", end: 1 << 62}
			vm := d.vRaw.set.join(other)
			if c.read {
				vm.reading(off, n, c.kind, c.cached)
			} else {
				vm.writing(off, n, c.kind)
			}
			if got := d.notified(); !sameDrops(got, c.want) {
				t.Errorf("notified %v, want %v", got, c.want)
			}
			if got := other.got(); len(got) > 0 {
				t.Errorf("the view of the request was notified: %v", got)
			}
			runtime.KeepAlive(vm)
		})
	}
}

// TestViewFaultWaitsBounded: at most faultWaits page faults wait for a
// writeback at once; another one meanwhile goes ahead without.
func TestViewFaultWaitsBounded(t *testing.T) {
	d := newTestDisk(true)
	d.vRaw.open(true, true) // the cached writer
	d.vP1.open(false, true) // direct
	d.raw.hold = make(chan struct{})
	var wg sync.WaitGroup
	for range faultWaits {
		wg.Go(func() { d.vP1.reading(1<<20, 4096, cachedIO, false) })
	}
	waitFor(t, "faultWaits faults waiting", func() bool {
		d.raw.mu.Lock()
		defer d.raw.mu.Unlock()
		return len(d.raw.drops) == faultWaits
	})
	done := make(chan struct{})
	go func() { d.vP1.reading(1<<20, 4096, cachedIO, false); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("a fault past faultWaits waited for a writeback")
	}
	close(d.raw.hold)
	wg.Wait()
	if got := len(d.raw.got()); got != faultWaits {
		t.Errorf("%d writebacks asked, want %d", got, faultWaits)
	}
}

// TestViewWrote: after a write, the other views that may hold pages of
// the bytes drop them, at once for a direct write, through the queue for a
// page-cache write (which returns without waiting for them, and fsync's
// barrier waits for); a view with no handle open drops all its pages and
// is skipped from then on, until it is read or opened again.
func TestViewWrote(t *testing.T) {
	d := newTestDisk(true)
	d.vRaw.open(true, true)      // with the page cache: may hold pages
	d.vP1.open(false, true)      // without (raw writes through its cache)
	d.vP2.cached()               // not open, but read once: may hold pages
	const off, n = 4 << 20, 8192 // raw's and p2's bytes, not p1's

	w := d.vP1.set.join(&fakeView{name: "writer", end: 1 << 62})
	w.wrote(off, n, directIO)
	want := map[string][]string{"raw": {"4194304+8192"}, "p2": {"4194304+-1"}}
	if got := d.notified(); !sameDrops(got, want) {
		t.Errorf("direct write: notified %v, want %v", got, want)
	}
	w.wrote(off, n, directIO)
	want = map[string][]string{"raw": {"4194304+8192"}}
	if got := d.notified(); !sameDrops(got, want) {
		t.Errorf("second direct write: notified %v, want %v (p2 dropped all its pages)", got, want)
	}

	// A page-cache write: queued; the write waits for nothing, even a
	// notification the kernel holds up; the barrier waits for it.
	d.raw.hold = make(chan struct{})
	returned := make(chan struct{})
	go func() { w.wrote(off, n, cachedIO); close(returned) }()
	select {
	case <-returned:
	case <-time.After(10 * time.Second):
		t.Fatal("a page-cache write waited for a notification")
	}
	barrier := make(chan struct{})
	early := false
	go func() {
		w.barrier()
		d.raw.mu.Lock()
		early = d.raw.done < 3
		d.raw.mu.Unlock()
		close(barrier)
	}()
	close(d.raw.hold)
	<-barrier
	if early {
		t.Error("the barrier returned before the queued notification was sent")
	}
	want = map[string][]string{"raw": {"4194304+8192"}}
	if got := d.notified(); !sameDrops(got, want) {
		t.Errorf("page-cache write: notified %v, want %v", got, want)
	}
	runtime.KeepAlive(w)
}

// TestViewGrew: a grow tells the other views of the new bytes (another
// node of the whole disk), whatever they cached; not the partitions.
func TestViewGrew(t *testing.T) {
	d := newTestDisk(true)
	w := d.vRaw.set.join(&fakeView{name: "writer", end: 1 << 62})
	w.grew(8<<20, 16<<20)
	want := map[string][]string{"raw": {"8388608+8388608"}}
	if got := d.notified(); !sameDrops(got, want) {
		t.Errorf("notified %v, want %v", got, want)
	}
	runtime.KeepAlive(w)
}

// TestImageNodeFileRange: a partition's node is told of the part of a
// disk range it shows, in its own offsets; the disk's node of all of it.
func TestImageNodeFileRange(t *testing.T) {
	part := &imageNode{part: 2, start: 4<<20 + 1536, size: 3 << 20}
	disk := &imageNode{}
	for _, c := range []struct {
		n          *imageNode
		off, size  int64
		o, l       int64
		overlapped bool
	}{
		{part, 4 << 20, 4096, 0, 4096 - 1536, true},
		{part, 4<<20 + 1536, 10, 0, 10, true},
		{part, 7<<20 + 1536 - 5, 100, 3<<20 - 5, 5, true},
		{part, 7<<20 + 1536, 100, 0, 0, false},
		{part, 0, 4<<20 + 1536, 0, 0, false},
		{disk, 12345, 678, 12345, 678, true},
	} {
		o, l := c.n.fileRange(c.off, c.size)
		if o != c.o || l != c.l || c.n.overlaps(c.off, c.size) != c.overlapped {
			t.Errorf("part %d: disk %d+%d: file %d+%d overlaps %v, want %d+%d %v", c.n.part, c.off, c.size, o, l, c.n.overlaps(c.off, c.size), c.o, c.l, c.overlapped)
		}
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// BenchmarkViewsOneFile is what the views add to a READ and a WRITE of a
// disk used through one file at a time: the request's kind recorded and
// found (kindsFS), reading, writing and wrote, with the disk's other two
// views (its partitions) looked up but never read.
func BenchmarkViewsOneFile(b *testing.B) {
	d := newTestDisk(true)
	d.vRaw.open(true, true)
	var k requestKinds
	b.RunParallel(func(pb *testing.PB) {
		c := make(chan struct{})
		ctx := &fuse.Context{Cancel: c}
		for pb.Next() {
			slot := k.start(c, cachedIO)
			kind := k.of(ctx)
			d.vRaw.reading(4<<20, 4096, kind, true)
			d.vRaw.cached()
			k.done(slot)

			slot = k.start(c, throughIO)
			kind = k.of(ctx)
			d.vRaw.writing(4<<20, 4096, kind)
			d.vRaw.wrote(4<<20, 4096, kind)
			k.done(slot)
		}
	})
	runtime.KeepAlive(d)
}
