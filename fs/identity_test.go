package fs

import "testing"

// TestObserveAfterClose: a stat taken while the mount's own handle was
// closing (its last writes still changing the file) must not count as
// another writer's change once the close has recorded the file's version;
// a stat taken after the close that differs does. (A lookup racing the
// kernel's RELEASE of a writer saw a new generation, and the writer's
// next open of the name failed with ESTALE.)
func TestObserveAfterClose(t *testing.T) {
	ids := newIdentities()
	k := fileKey{dev: 1, ino: 2}
	v1 := version{size: 1, mtime: 10, ctime: 10}
	v2 := version{size: 2, mtime: 20, ctime: 20} // our writes, mid-flush
	v3 := version{size: 2, mtime: 30, ctime: 30} // what our close recorded
	v4 := version{size: 3, mtime: 40, ctime: 40} // someone else's change

	g := ids.observe(k, v1, ids.now())
	if err := ids.opened(k, g, v1, ids.now()); err != nil {
		t.Fatal(err)
	}
	before := ids.now()
	// A lookup stats the file while the handle writes...
	stale := v2
	// ...and the handle closes before the lookup asks.
	ids.closed(k, v3)
	if got := ids.observe(k, stale, before); got != g {
		t.Errorf("a stat from before the last close made generation %d, want %d kept", got, g)
	}
	if got := ids.observe(k, v3, ids.now()); got != g {
		t.Errorf("the version the close recorded made generation %d, want %d", got, g)
	}
	if err := ids.opened(k, g, v3, ids.now()); err != nil {
		t.Errorf("open after the close: %v", err)
	}
	ids.closed(k, v3)
	if got := ids.observe(k, v4, ids.now()); got == g {
		t.Errorf("a change after the last close kept generation %d", g)
	}
}
