package main

import "testing"

// A peer stops early only when every one of its runs is far behind every
// run of qcowfs's, in every metric, and never the baselines.
func TestSettle(t *testing.T) {
	w := &workload{id: "t", metrics: []metric{{id: "cold", unit: mbps}, {id: "time", unit: seconds}}}
	mb := func(v ...float64) []sample { // MB/s values as 1 GB reads
		var ss []sample
		for _, x := range v {
			ss = append(ss, sample{bytes: 1e9, seconds: 1e3 / x})
		}
		return ss
	}
	secs := func(v ...float64) []sample {
		var ss []sample
		for _, x := range v {
			ss = append(ss, sample{seconds: x})
		}
		return ss
	}
	cases := []struct {
		name   string
		id     string
		q, p   []sample // cold MB/s
		qt, pt []sample // time
		want   bool
	}{
		{"far behind in both", "qemu", mb(1000, 900, 1100), mb(500, 550, 590), secs(1, 1.1), secs(2, 1.7), true},
		{"one run close", "qemu", mb(1000, 900, 1100), mb(500, 620, 590), nil, nil, false},
		{"close in time only", "qemu", mb(1000, 900, 1100), mb(500, 550, 590), secs(1, 1.1), secs(2, 1.6), false},
		{"ahead", "qcowmount", mb(500), mb(1000, 1000, 1000), nil, nil, false},
		{"baseline", "raw", mb(1000), mb(100, 100, 100), nil, nil, false},
		{"no numbers", "qemu", nil, nil, nil, nil, false},
		{"timed out runs are not numbers", "qemu", mb(1000), []sample{{timedOut: true, seconds: 15}}, nil, nil, false},
	}
	for _, tc := range cases {
		r := newResult(w)
		r.samples["cold"]["qcowfs"], r.samples["cold"][tc.id] = tc.q, tc.p
		r.samples["time"]["qcowfs"], r.samples["time"][tc.id] = tc.qt, tc.pt
		if got := r.settle(w, contestantByID(tc.id)); got != tc.want {
			t.Errorf("%s: settle = %v, want %v", tc.name, got, tc.want)
		}
	}
}
