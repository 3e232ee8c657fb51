package main

import "testing"

// A peer stops early only when every one of its runs is far behind every
// run of qcowfs's, in every metric, and never the baselines.
func TestSettle(t *testing.T) {
	w := &workload{id: "t", who: []string{"raw", "qcowfs", "qemu", "qcowmount"}, metrics: []metric{{id: "cold", unit: mbps}, {id: "time", unit: seconds}}}
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

// A peer far behind stops once it has run a majority of the runs planned,
// and not before; the subject is whichever contestant of the workload is
// qcowfs (a remote mount's qcowfs too).
func TestSettleNow(t *testing.T) {
	w := &workload{id: "t", who: []string{"qcowfs-remote", "qemu-http"}, metrics: []metric{{id: "time", unit: seconds}}}
	secs := func(v ...float64) []sample {
		var ss []sample
		for _, x := range v {
			ss = append(ss, sample{seconds: x})
		}
		return ss
	}
	peer := contestantByID("qemu-http")
	cases := []struct {
		runs, run int
		made      int // the peer's runs so far
		want      bool
	}{
		{3, 2, 1, false}, // 1 of 3 is no majority
		{3, 3, 2, true},
		{5, 3, 2, false},
		{5, 4, 3, true},
		{2, 2, 1, false},
	}
	for _, tc := range cases {
		r := newResult(w)
		r.samples["time"]["qcowfs-remote"] = secs(1, 1.2, 1.1)[:tc.made]
		r.samples["time"]["qemu-http"] = secs(3, 2, 4)[:tc.made]
		if got := r.settleNow(w, peer, tc.run, tc.runs); got != tc.want {
			t.Errorf("%d runs planned, before run %d: settleNow = %v, want %v", tc.runs, tc.run, got, tc.want)
		}
		if tc.want && len(r.notes["qemu-http"]) != 1 {
			t.Errorf("%d runs planned: notes %q, want one", tc.runs, r.notes["qemu-http"])
		}
	}
}

// A metric marked unsettled (a worst latency) does not hold a peer back.
func TestSettleUnsettled(t *testing.T) {
	for _, unsettled := range []bool{false, true} {
		w := &workload{id: "t", who: []string{"qcowfs", "qemu"}, metrics: []metric{
			{id: "p99", unit: millis}, {id: "max", unit: millis, unsettled: unsettled}}}
		r := newResult(w)
		ms := func(v ...float64) []sample {
			var ss []sample
			for _, x := range v {
				ss = append(ss, sample{v: x})
			}
			return ss
		}
		r.samples["p99"]["qcowfs"], r.samples["p99"]["qemu"] = ms(1, 1.2), ms(3, 4)
		r.samples["max"]["qcowfs"], r.samples["max"]["qemu"] = ms(20, 30), ms(10, 12) // qemu's worst is better
		if got := r.settle(w, contestantByID("qemu")); got != unsettled {
			t.Errorf("max unsettled=%v: settle = %v, want %v", unsettled, got, unsettled)
		}
	}
}
