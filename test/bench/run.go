package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"
)

// A result is what one workload measured: every run of every contestant,
// and why a contestant stopped before the last round.
type result struct {
	w      *workload
	who    []*contestant
	runs   map[string][]outcome // by contestant id, in round order
	status map[string]string    // "failed in round 2: ...", "timed out (> 20s) in round 1"
}

// measureFunc runs contestant c once on w: env.measure, or a test's fake.
type measureFunc func(w *workload, c *contestant, round int) (outcome, error)

// runAll runs each workload in turn: in each round, every contestant still
// in runs once, the first of the round rotating, so that no contestant
// always follows the same one. A contestant that fails or times out is out
// for the rest of the workload; a timed-out run stays as a bound. The
// probe runs in the first round only.
func runAll(ctx context.Context, ws []*workload, lineup func(*workload) []*contestant, rounds int,
	prepare func(*workload) error, measure measureFunc, log io.Writer) []*result {
	var out []*result
	for _, w := range ws {
		start := time.Now()
		r := &result{w: w, who: lineup(w), runs: map[string][]outcome{}, status: map[string]string{}}
		fmt.Fprintf(log, "== %s: %s\n", w.id, w.title)
		if err := prepare(w); err != nil {
			for _, c := range r.who {
				r.status[c.id] = "failed: " + err.Error()
			}
		}
		for round := 1; round <= rounds; round++ {
			for i := range r.who {
				c := r.who[(i+round-1)%len(r.who)]
				if r.status[c.id] != "" || (c.role == probe && round > 1) || ctx.Err() != nil {
					continue
				}
				o, err := measure(w, c, round)
				switch {
				case ctx.Err() != nil:
				case o.timedOut:
					r.runs[c.id] = append(r.runs[c.id], o)
					r.status[c.id] = fmt.Sprintf("%v in round %d", err, round)
				case err != nil:
					r.status[c.id] = fmt.Sprintf("failed in round %d: %v", round, err)
				default:
					r.runs[c.id] = append(r.runs[c.id], o)
				}
				fmt.Fprintf(log, "   %-22s round %d: %s\n", c.label, round, r.describe(c, o, err))
			}
		}
		fmt.Fprintf(log, "   took %s\n", time.Since(start).Round(time.Second))
		if ctx.Err() != nil {
			break
		}
		out = append(out, r)
	}
	return out
}

// describe is one run's line of progress.
func (r *result) describe(c *contestant, o outcome, err error) string {
	if err != nil {
		return err.Error()
	}
	var parts []string
	for _, m := range r.w.metrics {
		if v, ok := m.of(&o); ok {
			parts = append(parts, fmt.Sprintf("%s %s", num(v), m.unit))
		}
	}
	if o.note != "" {
		parts = append(parts, o.note)
	}
	return strings.Join(parts, ", ")
}

// measure is one run: c's target set up, the command timed with the
// daemon's meters read around it, the target closed (a written image is
// closed then), and the run verified.
func (e *env) measure(w *workload, c *contestant, round int) (o outcome, err error) {
	var t *target
	if w.keep {
		t, err = e.keptTarget(w, c)
	} else {
		t, err = e.setup(w, c)
	}
	defer func() {
		if t == nil || w.keep {
			return
		}
		if cerr := e.closeTarget(t); err == nil {
			err = cerr
		}
		for _, f := range t.files {
			os.RemoveAll(f)
		}
	}()
	if err != nil {
		return o, fmt.Errorf("setting up: %w", err)
	}
	if w.before != "" {
		if _, err := e.sh(w.before, t.vars...); err != nil {
			return o, err
		}
	}
	if w.cold {
		if err := dropCaches(); err != nil {
			return o, err
		}
	}
	limit := w.limit
	if limit == 0 {
		limit = 3 * time.Minute
	}
	before := readMeters(t)
	x := e.run(job{script: w.command(c), vars: t.vars, limit: limit})
	o = outcome{secs: x.secs, timedOut: x.timedOut, vals: map[string]float64{}, size: t.size, fileSize: t.fileSize}
	for k, v := range readMeters(t) {
		o.vals[k] = v - before[k]
	}
	if t.pid != 0 {
		o.rss = peakRSS(t.pid)
	}
	if x.err != nil {
		t.hung = x.timedOut
		return o, x.err
	}
	if err := parseLines(x.stdout+"\n"+x.stderr, &o); err != nil {
		return o, err
	}
	if w.parse != nil {
		if err := w.parse(x.stdout, &o); err != nil {
			return o, err
		}
	}
	if !w.keep {
		if err := e.closeTarget(t); err != nil {
			return o, err
		}
	}
	for k, v := range t.vals {
		o.vals[k] = v
	}
	if w.verify != nil {
		err = w.verify(e, t, &o, round)
	}
	return o, err
}

func readMeters(t *target) map[string]float64 {
	v := map[string]float64{}
	for _, m := range t.meters {
		for k, x := range m() {
			v[k] += x
		}
	}
	return v
}

// parseLines reads what a command says of itself: "@NAME VALUE" lines are
// values (lap's times, GNU time's peak RSS), "# text" lines the note.
func parseLines(out string, o *outcome) error {
	for _, line := range strings.Split(out, "\n") {
		if note, ok := strings.CutPrefix(line, "# "); ok {
			o.addNote(note)
		}
		name, v, ok := strings.Cut(strings.TrimPrefix(line, "@"), " ")
		if !ok || !strings.HasPrefix(line, "@") {
			continue
		}
		f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
		if err != nil {
			return fmt.Errorf("the command printed %q: %v", line, err)
		}
		o.vals[name] = f
	}
	return nil
}

// keptTarget is c's target for a workload that keeps its mounts across
// rounds: made at its first run, torn down when the next workload starts
// (releaseKept) or the bench ends. The targets of an earlier workload go
// first.
func (e *env) keptTarget(w *workload, c *contestant) (*target, error) {
	if e.keptFor != w.id {
		e.releaseKept()
		e.keptFor, e.kept = w.id, map[string]*target{}
	}
	if t := e.kept[c.id]; t != nil {
		return t, nil
	}
	t, err := e.setup(w, c)
	if err != nil {
		if t != nil {
			e.closeTarget(t)
		}
		return nil, err
	}
	e.kept[c.id] = t
	return t, nil
}

// releaseKept tears down the kept targets.
func (e *env) releaseKept() {
	for _, t := range e.kept {
		e.closeTarget(t)
		for _, f := range t.files {
			os.RemoveAll(f)
		}
	}
	e.kept, e.keptFor = nil, ""
}
