package main

import (
	"fmt"
	"io"
	"time"

	"github.com/qcowfs/qcowfs/remote"
)

// showHydration keeps one line on w (a terminal: qcowfs mount --foreground
// --hydrate) saying how far the hydrations are, rewritten in place every
// second while any runs: "hydrating 2 files: 41.5% of 2.0 GiB, 48.2
// MiB/s". When the last one ends the line says so once, with a newline,
// and the next hydration starts a new one. It returns what stops it.
func showHydration(w io.Writer, hydrations func() []remote.HydrationStatus) (stop func()) {
	done := make(chan struct{})
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		t := time.NewTicker(time.Second)
		defer t.Stop()
		shown := 0 // hydrations the last final line counted
		for {
			select {
			case <-done:
				return
			case <-t.C:
			}
			hs := hydrations()
			line, running := hydrationProgress(hs)
			switch {
			case running:
				fmt.Fprintf(w, "\r\x1b[K%s", line)
			case len(hs) > shown:
				fmt.Fprintf(w, "\r\x1b[K%s\n", line)
				shown = len(hs)
			}
		}
	}()
	return func() {
		close(done)
		<-ended
	}
}

// hydrationProgress sums hs into one line, and says whether any runs.
func hydrationProgress(hs []remote.HydrationStatus) (string, bool) {
	var needed, done, rate int64
	running := 0
	for _, h := range hs {
		needed += h.Needed
		done += h.Done
		if h.State == "running" {
			running++
			rate += h.Rate
		}
	}
	pct := 100.0
	if needed > 0 {
		pct = float64(int64(float64(done)/float64(needed)*1000)) / 10
	}
	if running > 0 {
		return fmt.Sprintf("hydrating %s: %.1f%% of %s, %s/s", plural(running, "file"), pct, mib(needed), mib(rate)), true
	}
	return fmt.Sprintf("hydrated %s: %.1f%% of %s", plural(len(hs), "file"), pct, mib(needed)), false
}
