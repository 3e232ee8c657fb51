package main

import (
	"strings"
	"testing"
)

func secs(v ...float64) []outcome {
	var os []outcome
	for _, x := range v {
		os = append(os, outcome{secs: x, size: 2e9})
	}
	return os
}

// The median of an odd and an even count, the range, and a bound only
// from a timed-out run, only in a metric that makes one.
func TestSummarize(t *testing.T) {
	tm := took("time", "")
	for _, c := range []struct {
		runs []outcome
		want stat
	}{
		{secs(3, 1, 2), stat{n: 3, med: 2, lo: 1, hi: 3}},
		{secs(4, 1, 2, 3), stat{n: 4, med: 2.5, lo: 1, hi: 4}},
		{[]outcome{{secs: 20, timedOut: true}}, stat{med: 20, bound: true}},
		{append(secs(5), outcome{secs: 20, timedOut: true}), stat{n: 1, med: 5, lo: 5, hi: 5}},
		{nil, stat{}},
	} {
		if got := summarize(tm, c.runs); got != c.want {
			t.Errorf("%v: %+v, want %+v", c.runs, got, c.want)
		}
	}
	if s := summarize(fetched, []outcome{{timedOut: true, vals: map[string]float64{"fetched": 1}, fileSize: 2}}); s.bound {
		t.Errorf("a count of a cut-off run is a bound: %+v", s)
	}
}

// qcowfs's advantage is above 1 when it is better, for a time as for a
// rate, and a bound when the other was cut off.
func TestAdvantage(t *testing.T) {
	tm, mb := took("time", ""), rate("MB/s", "", 0)
	q := summarize(tm, secs(2))
	for _, c := range []struct {
		m    metric
		o    []outcome
		want string
	}{
		{tm, secs(4), "2.00"},
		{tm, secs(1), "0.50"},
		{mb, secs(4), "2.00"},
		{tm, []outcome{{secs: 20, timedOut: true}}, "> 10.0"},
		{mb, []outcome{{secs: 20, timedOut: true, size: 2e9}}, "> 10.0"},
		{tm, nil, ""},
	} {
		qs := q
		if c.m.unit == "MB/s" {
			qs = summarize(mb, secs(2))
		}
		if got := advantage(c.m, qs, summarize(c.m, c.o)); got != c.want {
			t.Errorf("%s against %v: %q, want %q", c.m.name, c.o, got, c.want)
		}
	}
}

func TestNum(t *testing.T) {
	for v, want := range map[float64]string{0: "0", 1234.5: "1234", 56.78: "56.8", 1.234: "1.23", 0.9999: "1.00", 0.5: "0.50", 0.0123: "0.012"} {
		if got := num(v); got != want {
			t.Errorf("num(%v) = %q, want %q", v, got, want)
		}
	}
}

// The summary has a line per metric: qcowfs, its best peer and baseline,
// a peer cut off as a bound; a contestant that failed is left out.
func TestSummary(t *testing.T) {
	cs := []*contestant{{id: "raw", label: "raw", role: baseline}, {id: "q", label: "qcowfs", role: subject},
		{id: "e", label: "qemu", role: peer}, {id: "m", label: "qcowmount", role: peer}, {id: "x", label: "other", role: peer}}
	r := &result{w: &workload{id: "cp-x", metrics: []metric{took("time", "")}}, who: cs,
		runs:   map[string][]outcome{"raw": secs(0.5), "q": secs(1, 1.2, 0.9), "e": {{secs: 20, timedOut: true}}, "m": secs(3, 4, 5)},
		status: map[string]string{"x": "failed in round 1: no"}}
	got := summary([]*result{r}, nil)
	want := "| cp-x | time | 1.00 s | qcowmount: 4.00 s | **4.00** | raw: 0.50 s | **0.50** |"
	if !strings.Contains(got, want+"\n") {
		t.Errorf("summary:\n%s\nwant the line\n%s", got, want)
	}
	r.runs["m"] = nil
	if got := summary([]*result{r}, nil); !strings.Contains(got, "| qemu: > 20.0 s | **> 20.0** |") {
		t.Errorf("a cut-off peer is not a bound:\n%s", got)
	}
	if d := details([]*result{r}); !strings.Contains(d, "| cp-x | other | 0 |  | — | failed in round 1: no |") {
		t.Errorf("details:\n%s", d)
	}
}
