package fs

import (
	"testing"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// TestRequestKinds: each request in flight is found by its context with
// the kind recorded, however many share a hash or were freed before it;
// a request not recorded (no slot left, or not a FUSE context) counts as
// a page-cache one, which waits for nothing.
func TestRequestKinds(t *testing.T) {
	var k requestKinds
	kinds := []ioKind{cachedIO, directIO, throughIO}
	ctx := func(c chan struct{}) *fuse.Context { return &fuse.Context{Cancel: c} }
	chans := make([]chan struct{}, kindSlots+1)
	slots := make([]int, len(chans))
	for i := range chans {
		chans[i] = make(chan struct{})
		slots[i] = k.start(chans[i], kinds[i%3])
	}
	if slots[kindSlots] != -1 {
		t.Errorf("a request past a full table got slot %d", slots[kindSlots])
	}
	if got := k.of(ctx(chans[kindSlots])); got != cachedIO {
		t.Errorf("a request not recorded is %d, want cachedIO", got)
	}
	// Free every other one: the others are still found past the holes.
	for i := 0; i < kindSlots; i += 2 {
		k.done(slots[i])
	}
	for i := 1; i < kindSlots; i += 2 {
		if got := k.of(ctx(chans[i])); got != kinds[i%3] {
			t.Fatalf("request %d is %d, want %d", i, got, kinds[i%3])
		}
	}
	for i := 0; i < kindSlots; i += 2 {
		if got := k.of(ctx(chans[i])); got != cachedIO {
			t.Fatalf("request %d, done, is %d, want cachedIO", i, got)
		}
	}
	if got := k.of(t.Context()); got != cachedIO {
		t.Errorf("a context not go-fuse's is %d, want cachedIO", got)
	}
}
