package harness

import (
	"testing"
	"time"
)

// WaitFor polls cond until it holds or d passes (which fails the test):
// for conditions that an outside actor (the kernel, udev, a daemon) makes
// true asynchronously.
func WaitFor(t testing.TB, what string, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Within runs f, failing the test if it does not return within d: a
// request to a mount that must not hang (a hostile image, a stuck disk).
// f runs in a goroutine of its own, so it must not fail the test itself.
func Within[T any](t testing.TB, what string, d time.Duration, f func() (T, error)) (T, error) {
	t.Helper()
	type result struct {
		v   T
		err error
	}
	ch := make(chan result, 1)
	go func() {
		v, err := f()
		ch <- result{v, err}
	}()
	select {
	case r := <-ch:
		return r.v, r.err
	case <-time.After(d):
		t.Fatalf("%s did not answer within %v", what, d)
		var zero T
		return zero, nil
	}
}
