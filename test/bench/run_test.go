package main

import (
	"context"
	"errors"
	"io"
	"slices"
	"strings"
	"testing"
)

// Every round runs every contestant still in, the first rotating; one
// that fails is out for the rest of the workload, one that times out too,
// with its run kept as a bound; the probe runs once.
func TestRunAll(t *testing.T) {
	cs := []*contestant{{id: "a", role: subject}, {id: "b", role: peer}, {id: "c", role: peer}, {id: "d", role: baseline}, {id: "p", role: probe}}
	w := &workload{id: "w", metrics: []metric{took("time", "")}}
	var order []string
	measure := func(w *workload, c *contestant, round int) (outcome, error) {
		order = append(order, c.id)
		switch {
		case c.id == "c" && round == 2:
			return outcome{}, errors.New("boom")
		case c.id == "d":
			return outcome{secs: 20, timedOut: true}, errors.New("timed out (> 20s)")
		}
		return outcome{secs: float64(round)}, nil
	}
	rs := runAll(context.Background(), []*workload{w}, func(*workload) []*contestant { return cs }, 3,
		func(*workload) error { return nil }, measure, io.Discard)
	want := "a b c d p | b c a | a b"
	if got := strings.Join(order[:5], " ") + " | " + strings.Join(order[5:8], " ") + " | " + strings.Join(order[8:], " "); got != want {
		t.Errorf("order %q, want %q", got, want)
	}
	r := rs[0]
	if len(r.runs["a"]) != 3 || len(r.runs["c"]) != 1 || len(r.runs["d"]) != 1 || len(r.runs["p"]) != 1 {
		t.Errorf("runs kept: a %d, c %d, d %d, p %d", len(r.runs["a"]), len(r.runs["c"]), len(r.runs["d"]), len(r.runs["p"]))
	}
	if r.status["c"] != "failed in round 2: boom" || r.status["d"] != "timed out (> 20s) in round 1" || r.status["a"] != "" {
		t.Errorf("status %q", r.status)
	}
}

// A workload whose preparation fails runs nobody and says why.
func TestRunAllPrepareFails(t *testing.T) {
	cs := []*contestant{{id: "a"}}
	ran := false
	rs := runAll(context.Background(), []*workload{{id: "w"}}, func(*workload) []*contestant { return cs }, 3,
		func(*workload) error { return errors.New("no tar") },
		func(*workload, *contestant, int) (outcome, error) { ran = true; return outcome{}, nil }, io.Discard)
	if ran || rs[0].status["a"] != "failed: no tar" {
		t.Errorf("ran %v, status %q", ran, rs[0].status)
	}
}

// What a command says of itself: @ lines are values, # lines the note.
func TestParseLines(t *testing.T) {
	o := outcome{vals: map[string]float64{}}
	if err := parseLines("123\n@build 1234567e-6\n@rss 8000\n# image file 10 MiB\n", &o); err != nil {
		t.Fatal(err)
	}
	if o.vals["build"] != 1.234567 || o.vals["rss"] != 8000 || o.note != "image file 10 MiB" {
		t.Errorf("parsed %v, note %q", o.vals, o.note)
	}
	if err := parseLines("@x twelve\n", &o); err == nil {
		t.Error("a bad value parsed")
	}
}

// fio's JSON gives the writes' numbers when it wrote, the reads' otherwise.
func TestParseFio(t *testing.T) {
	const out = `note: both iodepth >= 1 and synchronous I/O engine are selected
{"jobs": [{"error": 0, "read": {"iops": 0, "total_ios": 0},
  "write": {"iops": 5000.5, "io_bytes": 61446144, "total_ios": 15001, "clat_ns": {"percentile": {"99.000000": 2500000}}, "lat_ns": {"max": 9e7}},
  "sync": {"lat_ns": {"percentile": {"99.000000": 1200000}}}}]}`
	o := outcome{vals: map[string]float64{}}
	if err := parseFio(out, &o); err != nil {
		t.Fatal(err)
	}
	for _, m := range []struct {
		m    metric
		want float64
	}{{iops, 5000.5}, {p99, 2.5}} {
		if v, _ := m.m.of(&o); v != m.want {
			t.Errorf("%s = %v, want %v", m.m.name, v, m.want)
		}
	}
	if o.vals["ios"] != 15001 || o.vals["sync-p99"] != 1.2e6 {
		t.Errorf("vals %v", o.vals)
	}
	if err := parseFio(`{"jobs": [{"error": 5}]}`, &o); err == nil {
		t.Error("a fio error parsed")
	}
}

// strace -c's table gives the calls on the image: lseek, ioctl (FIEMAP)
// and every kind of read.
func TestStraceCounts(t *testing.T) {
	const out = `% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 90.00    0.009000           2      4000           pread64
  6.00    0.000600           1       600       600 lseek
  4.00    0.000400           1       300           ioctl
  0.10    0.000010           1        10           read
------ ----------- ----------- --------- --------- ----------------
100.00    0.010010                  4910       600 total
`
	got := straceCounts(out)
	if got["reads"] != 4010 || got["lseek"] != 600 || got["fiemap"] != 300 || len(got) != 3 {
		t.Errorf("counts %v", got)
	}
	if !slices.Equal(strings.Split(straced, ","), []string{"lseek", "ioctl", "pread64", "read", "preadv", "preadv2"}) {
		t.Errorf("traced %q", straced)
	}
}
