package main

import (
	"errors"
	"fmt"
	"os/exec"
	"time"
)

// A wlResult is what one workload measured.
type wlResult struct {
	w       *workload
	samples map[string]map[string][]sample // metric id -> contestant id -> runs
	// status says why a contestant has no (or not all) numbers: "n/a:
	// ...", "failed: ...", "timed out ...". Empty: it ran every run.
	status map[string]string
	// skipped says, per metric and contestant, why a metric was not
	// measured although the contestant ran (a warm read skipped).
	skipped map[string]map[string]string
	notes   map[string][]string
	// rss is the peak RSS per contestant: its daemon's, or for a
	// command (qcowfs check) the largest of its runs.
	rss     map[string]int64
	elapsed time.Duration
	load    float64 // 1-minute load average when it started
	records []record
	// syscalls are the counts of the untimed strace pass, one per
	// traced daemon; syscallsNote says why there are none.
	syscalls     []syscallCount
	syscallsNote string
	// settled are the peers stopped early (settle).
	settled map[string]bool
}

// A record is one measurement as written to the JSON file.
type record struct {
	Workload   string  `json:"workload"`
	Metric     string  `json:"metric"`
	Contestant string  `json:"contestant"`
	Run        int     `json:"run"`
	Seconds    float64 `json:"seconds"`
	Bytes      int64   `json:"bytes,omitempty"`
	Value      float64 `json:"value"`
	Unit       string  `json:"unit"`
	Status     string  `json:"status"` // ok, timeout, failed
	Error      string  `json:"error,omitempty"`
	// CachedBefore is the part of the file in the page cache before a
	// warm read (fincore), 0 to 1.
	CachedBefore *float64 `json:"cached_before,omitempty"`
	// PeakRSS is the measured command's own peak RSS (check workloads).
	PeakRSS int64 `json:"peak_rss_bytes,omitempty"`
}

func newResult(w *workload) *wlResult {
	res := &wlResult{w: w, samples: map[string]map[string][]sample{}, status: map[string]string{},
		skipped: map[string]map[string]string{}, notes: map[string][]string{}, rss: map[string]int64{},
		settled: map[string]bool{}}
	for _, m := range w.metrics {
		res.samples[m.id] = map[string][]sample{}
		res.skipped[m.id] = map[string]string{}
	}
	return res
}

func (r *wlResult) fail(id, status string) {
	if r.status[id] == "" {
		r.status[id] = status
	}
}

// statusOf says why contestant id has no (or not all) numbers for metric:
// its status in the workload, or why the metric was skipped.
func (r *wlResult) statusOf(metric, id string) string {
	if s := r.status[id]; s != "" {
		return s
	}
	return r.skipped[metric][id]
}

// runWorkload exposes w's image through every contestant, then runs them
// interleaved: run 1 of each, then run 2 of each, and so on. A contestant
// that fails or times out is not run again in this workload; the others go
// on. Everything is torn down before it returns.
func (b *bench) runWorkload(w *workload) *wlResult {
	if w.write != nil {
		return b.runWriteWorkload(w)
	}
	res := newResult(w)
	start := time.Now()
	res.load = load1()
	defer func() { res.elapsed = time.Since(start) }()
	b.say("== %s: %s (%d runs)", w.id, w.title, b.runsOf(w))

	if w.tmpfs || w.outTmpfs {
		if err := b.ensureTmpfs(w); err != nil {
			for _, id := range w.who {
				res.fail(id, "failed: tmpfs: "+err.Error())
			}
			return res
		}
	}
	im := imageByName(w.image)
	exps := map[string]*exposure{}
	// closeExposure records a daemon's peak RSS, while it still runs,
	// and tears its exposure down.
	closeExposure := func(id string) {
		e := exps[id]
		if e == nil {
			return
		}
		if n := e.peak(); n > 0 {
			res.rss[id] = max(res.rss[id], n)
		}
		b.abortHung(e)
		for j := len(e.undos) - 1; j >= 0; j-- {
			b.undo(e.undos[j])
		}
		delete(exps, id)
	}
	defer func() {
		for i := len(w.who) - 1; i >= 0; i-- {
			closeExposure(w.who[i])
		}
	}()
	if w.remote != nil {
		if err := b.ensureRemote(w); err != nil {
			for _, id := range w.who {
				res.fail(id, "failed: "+err.Error())
			}
			return res
		}
	}
	// expose makes the image readable through contestant id; false if
	// it cannot, with the reason in res.
	expose := func(id string) bool {
		c := contestantByID(id)
		e, err := c.expose(b, im, b.imageRoot(w))
		if err != nil {
			if why, ok := w.na[id]; ok {
				fmt.Fprintf(b.log, "%s: %v\n", id, err)
				res.fail(id, "n/a: "+why)
			} else {
				res.fail(id, "failed: "+err.Error())
			}
			return false
		}
		e.c = c
		exps[id] = e
		if err := b.checkExposed(e, mustSize(b, im)); err != nil {
			res.fail(id, "failed: "+err.Error())
			return false
		}
		if w.prepare != nil {
			if err := w.prepare(b, w, e); err != nil {
				res.fail(id, "failed: "+err.Error())
				return false
			}
		}
		return true
	}
	for _, id := range w.who {
		c := contestantByID(id)
		if b.ctx.Err() != nil {
			return res
		}
		if prev := b.timedOutIn(w.skipIfTimedOut, id); prev != "" && c.role == peer {
			res.fail(id, "not run: "+prev)
			continue
		}
		if !b.haveTool(c) {
			res.fail(id, fmt.Sprintf("n/a: %s is not installed (package %s)", c.tool, c.pkg))
			continue
		}
		if c.expose == nil || w.freshExposure {
			continue
		}
		expose(id)
	}

	for run := 1; run <= b.runsOf(w); run++ {
		for _, id := range w.who {
			if res.status[id] != "" || res.settled[id] {
				continue
			}
			if b.ctx.Err() != nil {
				return res
			}
			c := contestantByID(id)
			if res.settleNow(w, c, run, b.runsOf(w)) {
				continue
			}
			// A fresh exposure for every run, made just before it and
			// closed right after: a daemon's own caches (a remote
			// mount's chunk cache) must not serve the next run, and no
			// idle daemon works in the background (or fetches) while
			// another contestant is measured.
			if w.freshExposure && c.expose != nil {
				if !expose(id) {
					continue
				}
			}
			samples, err := w.measure(b, w, c, exps[id], run)
			if w.freshExposure && c.expose != nil {
				if errors.Is(err, errTimedOut) {
					exps[id].hung = true
				}
				closeExposure(id)
			}
			if b.ctx.Err() != nil {
				return res
			}
			// Every sample but a failed last one is a measurement.
			for i, s := range samples {
				res.add(w, id, run, s, err != nil && i == len(samples)-1, err)
				res.rss[id] = max(res.rss[id], s.rss)
			}
			switch {
			case errors.Is(err, errTimedOut):
				// Slow or hung: either way, tear it down without
				// asking it anything (a hung daemon blocks even a
				// stat of its mount point).
				if e := exps[id]; e != nil {
					e.hung = true
				}
				var last sample
				if len(samples) > 0 {
					last = samples[len(samples)-1]
				}
				res.fail(id, fmt.Sprintf("%s in run %d; not run again", b.cutOff(w, last), run))
			case err != nil:
				res.fail(id, fmt.Sprintf("failed in run %d: %v", run, err))
			}
			if err != nil {
				fmt.Printf("   %-20s run %d: %v\n", c.label, run, err)
			} else {
				fmt.Printf("   %-20s run %d: %s\n", c.label, run, describeSamples(w, samples))
			}
		}
	}
	// The strace pass comes last because strace slows the daemons it
	// traces (on mounts of its own: see syscalls.go).
	switch {
	case w.syscalls == nil || b.ctx.Err() != nil:
	case !b.cfg.strace:
		res.syscallsNote = "not counted in this run (--strace=false)"
	default:
		b.countSyscalls(w, res)
	}
	return res
}

// A peer that is far behind is not run to the end: once it has run a
// majority of the runs planned (3 of 4 or 5, 2 of 3), a peer every one of whose
// runs is at least settleFactor behind the subject's (qcowfs's) worst run
// so far, in every metric but those marked unsettled, stops there. Its
// median is then settled: with a majority of the runs past that line, the
// median of all of them would be past it too, whatever the rest measured.
// More runs would refine a number no verdict depends on, and the slowest
// peers take most of a run's time. qcowfs, the baselines (the raw file,
// qemu-img convert, curl) and every peer closer than that run to the end.
const settleFactor = 1.5

// settleAfter is the runs a peer makes before it may stop: a majority of
// the runs planned.
func settleAfter(runs int) int { return runs/2 + 1 }

// settleNow says whether peer c, not settled yet, stops before run (of
// runs planned), and marks and notes it when it does.
func (r *wlResult) settleNow(w *workload, c *contestant, run, runs int) bool {
	if run <= settleAfter(runs) || !r.settle(w, c) {
		return false
	}
	r.settled[c.id] = true
	r.notes[c.id] = append(r.notes[c.id], fmt.Sprintf("stopped after %d runs: every one at least %.1fx behind qcowfs's worst", run-1, settleFactor))
	return true
}

// settle says whether peer c may stop (above).
func (r *wlResult) settle(w *workload, c *contestant) bool {
	if c.role != peer {
		return false
	}
	subj := subjectOf(w)
	compared := false
	for _, m := range w.metrics {
		if m.unsettled {
			continue
		}
		q, _ := summarize(r.samples[m.id][subj], m.unit)
		p, _ := summarize(r.samples[m.id][c.id], m.unit)
		if q.n == 0 || p.n == 0 {
			continue
		}
		// q.lo is the subject's worst run, p.hi the peer's best.
		if m.unit.lowerBetter() && p.hi < settleFactor*q.lo || !m.unit.lowerBetter() && p.hi*settleFactor > q.lo {
			return false
		}
		compared = true
	}
	return compared
}

// add records a sample: in the table when it is a complete measurement
// (or a timeout: a lower bound), and in the JSON records in any case. err,
// when failed, is why this sample is not a measurement.
func (r *wlResult) add(w *workload, id string, run int, s sample, failed bool, err error) {
	var u unit
	for _, m := range w.metrics {
		if m.id == s.metric {
			u = m.unit
		}
	}
	rec := record{Workload: w.id, Metric: s.metric, Contestant: id, Run: run, Seconds: s.seconds,
		Bytes: s.bytes, Unit: u.String(), Status: "ok", PeakRSS: s.rss}
	if s.skipped != "" {
		rec.Status, rec.Error, rec.Seconds = "skipped", s.skipped, 0
		r.records = append(r.records, rec)
		if r.skipped[s.metric] != nil && r.skipped[s.metric][id] == "" {
			r.skipped[s.metric][id] = s.skipped
		}
		return
	}
	switch {
	case s.timedOut:
		rec.Status = "timeout"
	case failed:
		rec.Status = "failed"
	}
	if failed && err != nil {
		rec.Error = err.Error()
	}
	if rec.Status == "ok" {
		rec.Value = s.value(u)
	}
	if s.hasCached {
		c := s.cached
		rec.CachedBefore = &c
	}
	r.records = append(r.records, rec)
	if _, ok := r.samples[s.metric]; !ok {
		return // not a tabled metric
	}
	if rec.Status != "failed" {
		r.samples[s.metric][id] = append(r.samples[s.metric][id], s)
	}
	if s.note != "" && rec.Status == "ok" {
		r.notes[id] = append(r.notes[id], s.note)
	}
}

func describeSamples(w *workload, ss []sample) string {
	out := ""
	for _, s := range ss {
		for _, m := range w.metrics {
			if m.id != s.metric {
				continue
			}
			if out != "" {
				out += ", "
			}
			if s.skipped != "" {
				out += m.id + " skipped"
				continue
			}
			switch m.unit {
			case mbps:
				out += fmt.Sprintf("%s %.0f MB/s (%.2f s)", m.id, s.value(mbps), s.seconds)
			case iops:
				out += fmt.Sprintf("%.0f IOPS", s.ops)
			case millis, micros, factor:
				out += m.id + " " + cell(m.unit, s.value(m.unit), s.seconds)
			default:
				out += fmt.Sprintf("%.2f s", s.seconds)
			}
			if s.rss > 0 {
				out += ", peak RSS " + humanBytes(s.rss)
			}
			if s.note != "" {
				out += "; " + s.note
			}
		}
	}
	return out
}

// timedOutIn says whether contestant id timed out in the workload named
// wid earlier in this run.
func (b *bench) timedOutIn(wid, id string) string {
	if wid == "" {
		return ""
	}
	for _, r := range b.results {
		if r.w.id != wid {
			continue
		}
		for _, m := range r.w.metrics {
			for _, s := range r.samples[m.id][id] {
				if s.timedOut {
					return fmt.Sprintf("%s in %s", b.cutOff(r.w, s), wid)
				}
			}
		}
	}
	return ""
}

// runsOf is the number of runs per contestant in w: the workload's own
// unless --runs was given.
func (b *bench) runsOf(w *workload) int {
	if w.runs > 0 && !b.cfg.runsSet {
		return min(w.runs, b.cfg.runs)
	}
	return b.cfg.runs
}

func (b *bench) haveTool(c *contestant) bool {
	if c.tool == "qcowfs" {
		return true // the binary under test, checked at the start
	}
	_, err := exec.LookPath(c.tool)
	return err == nil
}

func mustSize(b *bench, im *image) int64 {
	n, err := b.size(im)
	if err != nil {
		return -1
	}
	return n
}
