package main

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"slices"
	"strings"
	"time"
)

// marker separates the report's hand-written head, kept, from what the
// bench writes below it.
const marker = "<!-- Written by `make bench` below this line: edit above it. -->"

// A stat sums up one contestant's runs in one metric.
type stat struct {
	n           int     // runs with a value
	med, lo, hi float64 // their median and range
	bound       bool    // no value but a timed-out run's: med is the limit's, a bound
}

func summarize(m metric, runs []outcome) stat {
	var vs []float64
	var s stat
	for _, o := range runs {
		v, ok := m.of(&o)
		switch {
		case !ok || math.IsNaN(v) || math.IsInf(v, 0):
		case o.timedOut:
			s.med, s.bound = v, m.bounded
		default:
			vs = append(vs, v)
		}
	}
	if len(vs) == 0 {
		return s
	}
	slices.Sort(vs)
	s = stat{n: len(vs), lo: vs[0], hi: vs[len(vs)-1], med: vs[len(vs)/2]}
	if len(vs)%2 == 0 {
		s.med = (vs[len(vs)/2-1] + vs[len(vs)/2]) / 2
	}
	return s
}

// show renders a median with its unit; a bound says which way it goes.
func (s stat) show(m metric) string {
	switch {
	case s.bound && m.lower:
		return "> " + num(s.med) + " " + m.unit
	case s.bound:
		return "< " + num(s.med) + " " + m.unit
	case s.n == 0:
		return "—"
	}
	switch m.unit {
	case "x":
		return num(s.med) + "x"
	case "calls":
		return fmt.Sprintf("%.0f calls", s.med)
	}
	return strings.TrimSpace(num(s.med) + " " + m.unit)
}

// advantage is how many times better q (qcowfs) is than o in m: o ÷ q
// for a time, q ÷ o for a rate; above 1, qcowfs is better.
func advantage(m metric, q, o stat) string {
	if q.n == 0 || (o.n == 0 && !o.bound) || q.med == 0 || o.med == 0 {
		return ""
	}
	r := q.med / o.med
	if m.lower {
		r = o.med / q.med
	}
	if o.bound {
		return "> " + num(r) // o is at least as bad as its bound
	}
	return num(r)
}

func bold(s string) string {
	if s == "" {
		return ""
	}
	return "**" + s + "**"
}

// num has three significant digits and no exponent.
func num(v float64) string {
	switch a := math.Abs(v); {
	case a >= 100 || a == 0:
		return fmt.Sprintf("%.0f", v)
	case a >= 10:
		return fmt.Sprintf("%.1f", v)
	case a >= 0.095:
		return fmt.Sprintf("%.2f", v)
	}
	return fmt.Sprintf("%.2g", v)
}

// best is the contestant of role with the best median in m (one that
// only timed out if none finished), or nil.
func (r *result) best(m metric, want role) *contestant {
	better := func(s, than stat) bool {
		switch {
		case s.bound != than.bound:
			return !s.bound // a median beats a bound
		case m.lower:
			return s.med < than.med
		}
		return s.med > than.med
	}
	var best *contestant
	var bs stat
	for _, c := range r.who {
		s := summarize(m, r.runs[c.id])
		if c.role == want && (s.n > 0 || s.bound) && (best == nil || better(s, bs)) {
			best, bs = c, s
		}
	}
	return best
}

// subjectStat is qcowfs's numbers in m, or the probe's for a count.
func (r *result) subjectStat(m metric) (stat, *contestant) {
	want := subject
	if m.count {
		want = probe
	}
	for _, c := range r.who {
		if s := summarize(m, r.runs[c.id]); c.role == want && s.n > 0 {
			return s, c
		}
	}
	return stat{}, nil
}

// summary is one line per metric: qcowfs, its best peer and baseline, and
// every other build of qcowfs, with qcowfs's advantage over each.
func summary(rs []*result, refs []*contestant) string {
	var b strings.Builder
	b.WriteString("| workload | metric | qcowfs | best peer | qcowfs vs it | best baseline | qcowfs vs it |")
	for _, c := range refs {
		fmt.Fprintf(&b, " %s | vs it |", c.label)
	}
	b.WriteString("\n|" + strings.Repeat(" --- |", 7+2*len(refs)) + "\n")
	for _, r := range rs {
		var counts []string // the probe's, on one line
		for _, m := range r.w.metrics {
			q, qc := r.subjectStat(m)
			switch {
			case qc == nil:
				continue
			case m.count:
				counts = append(counts, m.name+": "+q.show(m))
				continue
			}
			row := fmt.Sprintf("| %s | %s | %s |", r.w.id, m.name, q.show(m))
			for _, want := range []role{peer, baseline} {
				if c := r.best(m, want); c != nil {
					o := summarize(m, r.runs[c.id])
					row += fmt.Sprintf(" %s: %s | %s |", c.label, o.show(m), bold(advantage(m, q, o)))
				} else {
					row += " | |"
				}
			}
			for _, c := range refs {
				o := summarize(m, r.runs[c.id])
				row += fmt.Sprintf(" %s | %s |", o.show(m), advantage(m, q, o))
			}
			b.WriteString(row + "\n")
		}
		if counts != nil {
			fmt.Fprintf(&b, "| %s | under strace | %s |%s\n", r.w.id, strings.Join(counts, ", "), strings.Repeat(" |", 4+2*len(refs)))
		}
	}
	return b.String()
}

// details is a table per group: every contestant's runs in every metric,
// median and range, with why it stopped, if it did.
func details(rs []*result) string {
	var b strings.Builder
	group := ""
	for _, r := range rs {
		if r.w.group != group {
			group = r.w.group
			fmt.Fprintf(&b, "\n### %s\n\n| workload | contestant | runs | median (range) | peak RSS | notes |\n| --- | --- | --- | --- | --- | --- |\n", group)
		}
		for _, c := range r.who {
			var cells, notes []string
			for _, m := range r.w.metrics {
				if s := summarize(m, r.runs[c.id]); s.n > 0 && m.count == (c.role == probe) {
					cells = append(cells, fmt.Sprintf("%s: %s (%s–%s)", m.name, s.show(m), num(s.lo), num(s.hi)))
				} else if s.bound {
					cells = append(cells, m.name+": "+s.show(m))
				}
			}
			var rss int64
			for i, o := range r.runs[c.id] {
				rss = max(rss, o.rss)
				if i == 0 && o.note != "" { // the first run's: its checks
					notes = append(notes, o.note)
				}
			}
			if st := r.status[c.id]; st != "" {
				notes = append(notes, st)
			}
			mem := "—"
			if rss > 0 {
				mem = fmt.Sprintf("%d MiB", rss>>20)
			}
			fmt.Fprintf(&b, "| %s | %s | %d | %s | %s | %s |\n", r.w.id, c.label, len(r.runs[c.id]),
				strings.Join(cells, "; "), mem, strings.ReplaceAll(strings.Join(notes, "; "), "|", `\|`))
		}
	}
	return b.String()
}

// commands lists what every workload runs, once per distinct command.
func commands(rs []*result) string {
	var order []string
	ids := map[string][]string{}
	for _, r := range rs {
		text := ""
		for _, p := range [][2]string{{"untimed before: ", r.w.before}, {"", r.w.cmd}, {"untimed after: ", r.w.after}} {
			if p[1] != "" {
				text += fmt.Sprintf("  %s`%s`\n", p[0], strings.ReplaceAll(p[1], "\n", "; "))
			}
		}
		for _, c := range r.who {
			if s, ok := r.w.own[c.id]; ok {
				text += fmt.Sprintf("  %s: `%s`\n", c.label, s)
			}
		}
		if ids[text] == nil {
			order = append(order, text)
		}
		ids[text] = append(ids[text], r.w.id)
	}
	var b strings.Builder
	for _, text := range order {
		fmt.Fprintf(&b, "- %s:\n%s", strings.Join(ids[text], ", "), text)
	}
	return b.String()
}

// writeReport replaces what is below the marker of path with this run's
// results, and writes the raw numbers next to it (.json).
func writeReport(path string, rs []*result, refs []*contestant, m machine, rounds int, took time.Duration) error {
	head := "# Benchmarks\n\n" + marker + "\n"
	if old, err := os.ReadFile(path); err == nil {
		if i := strings.Index(string(old), marker); i >= 0 {
			head = string(old[:i]) + marker + "\n"
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\n## The latest run\n\n%s\n", m.markdown(rounds, took))
	fmt.Fprintf(&b, "### Summary\n\nMedians of %d interleaved rounds; \"qcowfs vs it\": how many times better qcowfs is (its time or latency divided into the other's, "+
		"or the other's rate into its own), above 1 when qcowfs is better; \"> x\": the other was cut off at the workload's limit, so at least x.\n\n%s",
		rounds, summary(rs, refs))
	b.WriteString(details(rs))
	b.WriteString("\n### Contestants\n\n| contestant | how |\n| --- | --- |\n")
	var seen []*contestant
	for _, r := range rs {
		for _, c := range r.who {
			if !slices.Contains(seen, c) {
				seen = append(seen, c)
				fmt.Fprintf(&b, "| %s | %s |\n", c.label, c.how)
			}
		}
	}
	fmt.Fprintf(&b, "\n### Commands\n\nbash, with the variables of `test/bench/targets.go` (`$FILE` is the contestant's file).\n\n%s", commands(rs))
	if err := os.WriteFile(path, []byte(head+b.String()), 0o644); err != nil {
		return err
	}
	return writeJSON(strings.TrimSuffix(path, ".md")+".json", rs, m, rounds, took)
}

// writeJSON writes every run's metrics, a line per workload.
func writeJSON(path string, rs []*result, m machine, rounds int, took time.Duration) error {
	type run struct {
		Values   map[string]float64 `json:"values"`
		TimedOut bool               `json:"timed_out,omitempty"`
		Note     string             `json:"note,omitempty"`
	}
	type entry struct {
		Contestant string `json:"contestant"`
		Status     string `json:"status,omitempty"`
		Runs       []run  `json:"runs"`
	}
	head, _ := json.Marshal(struct {
		Machine machine `json:"machine"`
		Rounds  int     `json:"rounds"`
		Took    string  `json:"took"`
	}{m, rounds, took.Round(time.Second).String()})
	var b strings.Builder
	b.WriteString(strings.TrimSuffix(string(head), "}") + `,"workloads":{` + "\n")
	for i, r := range rs {
		var es []entry
		for _, c := range r.who {
			e := entry{Contestant: c.id, Status: r.status[c.id], Runs: []run{}}
			for _, o := range r.runs[c.id] {
				v := map[string]float64{}
				for _, mt := range r.w.metrics {
					if x, ok := mt.of(&o); ok && !math.IsNaN(x) && !math.IsInf(x, 0) {
						v[mt.name] = round4(x)
					}
				}
				e.Runs = append(e.Runs, run{v, o.timedOut, o.note})
			}
			es = append(es, e)
		}
		line, _ := json.Marshal(es)
		fmt.Fprintf(&b, "%q:%s", r.w.id, line)
		if i < len(rs)-1 {
			b.WriteString(",")
		}
		b.WriteString("\n")
	}
	b.WriteString("}}\n")
	return os.WriteFile(path, []byte(b.String()), 0o644)
}

// round4 keeps four significant digits.
func round4(x float64) float64 {
	if x == 0 {
		return 0
	}
	p := math.Pow(10, 3-math.Floor(math.Log10(math.Abs(x))))
	return math.Round(x*p) / p
}
