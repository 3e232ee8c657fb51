package main

import (
	"context"
	"io"
	"testing"
	"time"
)

// A command that reads and writes nothing is cut off as stalled once the
// stall time has passed, long before its timeout; one that keeps moving
// bytes, slowly, runs to its end.
func TestStall(t *testing.T) {
	b := &bench{ctx: context.Background(), log: io.Discard, cfg: config{timeout: time.Minute}}
	r := b.run(&cmd{name: "sleep", args: []string{"30"}, stall: 2 * time.Second})
	if !r.stalled || !r.timedOut || r.elapsed > 10*time.Second {
		t.Errorf("sleep 30: stalled %v, timed out %v after %v; want cut off as stalled within 10 s (%v)", r.stalled, r.timedOut, r.elapsed, r.err)
	}
	s, err := r.sample("time")
	if !s.stalled || err == nil {
		t.Errorf("the stalled run's sample: stalled %v, error %v", s.stalled, err)
	}
	// A byte every half second, for 5 s: never 2 s without one. The
	// child does the I/O, so the whole process group is watched.
	r = b.run(&cmd{name: "sh", args: []string{"-c", "for i in 1 2 3 4 5 6 7 8 9 10; do sh -c 'head -c 1 /dev/zero'; sleep 0.5; done > /dev/null"},
		stall: 2 * time.Second})
	if r.stalled || r.err != nil {
		t.Errorf("a slow writer was cut off: stalled %v after %v (%v)", r.stalled, r.elapsed, r.err)
	}
}
