package fs

import (
	"context"
	"reflect"
	"sync/atomic"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// How the kernel sent a READ or WRITE: through the page cache or not
// (views.go needs to know whether the request holds pages). The flags
// say it and go-fuse's node API does not pass them on, so kindsFS,
// wrapping the node file system, records each request's kind under its
// cancel channel (go-fuse hands the same channel to the node's method in
// its context) for as long as the request is served:
//
//   - a READ with FUSE_READ_LOCKOWNER is direct I/O (fuse_direct_io sets
//     it, with the caller's files as lock owner); without, the page
//     cache reading pages in;
//   - a WRITE with FUSE_WRITE_CACHE is the page cache writing a dirty
//     page back; with FUSE_WRITE_LOCKOWNER, direct I/O; with neither, a
//     write(2) through the page cache without the writeback cache, or a
//     direct write from a kernel thread (a loop device's), which has no
//     files to name as lock owner.

// requestKinds is a table of the requests in flight: each slot holds a
// cancel channel's address with the kind in its low bits (a channel is
// 8-byte aligned), or 0. A request takes the first free slot from its
// hash on, and is found again by probing from there: its slot is in the
// way, whatever was freed before it since. Every READ and WRITE passes
// through it, so it takes no lock and allocates nothing (a sync.Map took
// about 0.4 µs a request). A request that finds no free slot (more in
// flight than slots) is not recorded, and is taken for a page-cache one,
// which waits for nothing.
type requestKinds struct {
	slots [kindSlots]atomic.Uintptr
}

const kindSlots = 1024

func channelKey(cancel <-chan struct{}) uintptr { return reflect.ValueOf(cancel).Pointer() }

func kindHash(key uintptr) int { return int(uint64(key>>3) * 0x9e3779b97f4a7c15 >> 54 % kindSlots) }

// start records the kind of the request with cancel channel cancel; done
// forgets it, and must follow.
func (k *requestKinds) start(cancel <-chan struct{}, kind ioKind) (slot int) {
	key := channelKey(cancel)
	h := kindHash(key)
	for i := range kindSlots {
		s := (h + i) % kindSlots
		if k.slots[s].CompareAndSwap(0, key|uintptr(kind)) {
			return s
		}
	}
	return -1
}

func (k *requestKinds) done(slot int) {
	if slot >= 0 {
		k.slots[slot].Store(0)
	}
}

// of is the kind of the READ or WRITE being served with ctx; a page-cache
// one, which waits for nothing, if unknown.
func (k *requestKinds) of(ctx context.Context) ioKind {
	c, ok := ctx.(*fuse.Context)
	if !ok || c.Cancel == nil {
		return cachedIO
	}
	key := channelKey(c.Cancel)
	h := kindHash(key)
	for i := range kindSlots {
		if v := k.slots[(h+i)%kindSlots].Load(); v&^7 == key {
			return ioKind(v & 7)
		}
	}
	return cachedIO
}

// kindsFS records the kind of every READ and WRITE while it is served.
type kindsFS struct {
	fuse.RawFileSystem
	kinds *requestKinds
}

func (f kindsFS) Read(cancel <-chan struct{}, in *fuse.ReadIn, buf []byte) (fuse.ReadResult, fuse.Status) {
	kind := cachedIO
	if in.ReadFlags&fuse.READ_LOCKOWNER != 0 {
		kind = directIO
	}
	defer f.kinds.done(f.kinds.start(cancel, kind))
	return f.RawFileSystem.Read(cancel, in, buf)
}

func (f kindsFS) Write(cancel <-chan struct{}, in *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	defer f.kinds.done(f.kinds.start(cancel, writeKind(in)))
	return f.RawFileSystem.Write(cancel, in, data)
}

func (f kindsFS) Writev(cancel <-chan struct{}, in *fuse.WriteIn, data [][]byte) (uint32, fuse.Status) {
	defer f.kinds.done(f.kinds.start(cancel, writeKind(in)))
	return f.RawFileSystem.Writev(cancel, in, data)
}

func writeKind(in *fuse.WriteIn) ioKind {
	switch {
	case in.WriteFlags&fuse.WRITE_CACHE != 0:
		return cachedIO
	case in.WriteFlags&fuse.WRITE_LOCKOWNER != 0:
		return directIO
	}
	return throughIO
}
