package remote

import (
	"bytes"
	"fmt"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/servers"
)

// hydrateSpans overlap, touch, and run past the end of the 8 MiB object
// of the hydration tests.
var hydrateSpans = []Span{{100 << 10, 300 << 10}, {3 << 20, 1 << 20}, {3<<20 + 512<<10, 1 << 20}, {8<<20 - 100<<10, 1 << 20}, {6 << 20, 1}}

// spanBytes is the bytes of the union of hydrateSpans within size.
func spanBytes(size int64) int64 {
	in := make([]bool, size)
	for _, s := range hydrateSpans {
		for p := s.Off; p < min(s.Off+s.Len, size); p++ {
			in[p] = true
		}
	}
	var n int64
	for _, b := range in {
		if b {
			n++
		}
	}
	return n
}

// parseRange reads nginx's logged Range header "bytes=A-B".
func parseRange(t *testing.T, r string) (lo, hi int64) {
	t.Helper()
	if _, err := fmt.Sscanf(r, "bytes=%d-%d", &lo, &hi); err != nil {
		t.Fatalf("range %q: %v", r, err)
	}
	return lo, hi + 1
}

// waitHydrated waits for h to end and returns its status.
func waitHydrated(t *testing.T, h *Hydration, d time.Duration) HydrationStatus {
	t.Helper()
	select {
	case <-h.Done():
	case <-time.After(d):
		t.Fatalf("hydration still running after %v: %+v", d, h.Status())
	}
	return h.Status()
}

// TestHydrate: an object's spans hydrated into the disk cache. nginx's
// log shows each chunk the spans touch fetched once and nothing else;
// the status counts the spans' bytes (overlaps once, none past the end).
// A second Client over the same cache folder (a later mount) finds every
// chunk there and fetches nothing. With nginx stopped, reads of the spans
// still return the object's bytes (from the disk cache), and a read
// elsewhere fails: only what was asked for was fetched.
func TestHydrate(t *testing.T) {
	const size = 8 << 20
	ng, data := nginxWith(t, size, false)
	var log logBuf
	opts := testOptions(&log)
	opts.CacheDir = t.TempDir()
	c := newClient(t, opts)
	o := open(t, c, ng.URL+"/disk.img")
	before := len(ng.WaitLog(t, 1))
	h, err := o.Hydrate(hydrateSpans)
	if err != nil {
		t.Fatal(err)
	}
	st := waitHydrated(t, h, 30*time.Second)
	want := spanBytes(size)
	if st.State != "complete" || st.Needed != want || st.Done != want || st.Percent != 100 {
		t.Errorf("hydration status %+v; want complete, %d bytes needed and done", st, want)
	}
	cs := opts.ChunkSize
	chunks := map[int64]bool{}
	for _, s := range hydrateSpans {
		for p := s.Off / cs * cs; p < min(s.Off+s.Len, size); p += cs {
			chunks[p/cs] = true
		}
	}
	fetched := map[int64]int{}
	var total int64
	log0 := ng.Log(t)[:before]
	for _, a := range ng.WaitBodyBytes(t, servers.BodyBytes(log0)+st.Fetched)[before:] {
		lo, hi := parseRange(t, a.Range)
		total += hi - lo
		for p := lo; p < hi; p += cs {
			fetched[p/cs]++
		}
	}
	for idx, n := range fetched {
		if !chunks[idx] || n != 1 {
			t.Errorf("chunk %d fetched %d times; spans touch it: %v", idx, n, chunks[idx])
		}
	}
	if len(fetched) != len(chunks) || st.Fetched != total {
		t.Errorf("%d chunks fetched (%d bytes, status says %d), want the %d the spans touch", len(fetched), total, st.Fetched, len(chunks))
	}
	if ss := c.Stats().Hydration; len(ss) != 1 || ss[0].State != "complete" {
		t.Errorf("Client.Stats().Hydration = %+v", ss)
	}

	// A later Client over the same folder starts warm. (A short
	// timeout: its read outside the spans, nginx stopped, fails soon.)
	opts.Timeout = time.Second
	c2 := newClient(t, opts)
	o2 := open(t, c2, ng.URL+"/disk.img")
	n := len(ng.WaitLog(t, before+1))
	h2, err := o2.Hydrate(hydrateSpans)
	if err != nil {
		t.Fatal(err)
	}
	if st := waitHydrated(t, h2, 30*time.Second); st.State != "complete" || st.Done != want || st.Fetched != 0 {
		t.Errorf("hydration over a warm cache: %+v; want complete with nothing fetched", st)
	}
	if got := ng.Log(t); len(got) != n {
		t.Errorf("hydration over a warm cache sent %d requests", len(got)-n)
	}

	ng.Stop()
	for _, s := range hydrateSpans {
		end := min(s.Off+s.Len, size)
		p := make([]byte, end-s.Off)
		if _, err := o2.ReadAt(p, s.Off); err != nil || !bytes.Equal(p, data[s.Off:end]) {
			t.Errorf("read of hydrated [%d, %d) with nginx stopped: %v (equal %v)", s.Off, end, err, bytes.Equal(p, data[s.Off:end]))
		}
	}
	if _, err := o2.ReadAt(make([]byte, 4096), 5<<20); err == nil {
		t.Errorf("a read outside the spans succeeded with nginx stopped: more than the spans was hydrated")
	}
}

// TestHydrateRate: HydrateRate holds: 4 MiB at 1 MiB a second take at
// least 3.2 s (20 % slack), and the status's rate is within 20 % of the
// cap; without a cap the same takes far less.
func TestHydrateRate(t *testing.T) {
	ng, _ := nginxWith(t, 8<<20, false)
	opts := testOptions(nil)
	opts.CacheDir = t.TempDir()
	opts.HydrateRate = 1 << 20
	c := newClient(t, opts)
	o := open(t, c, ng.URL+"/disk.img")
	start := time.Now()
	h, err := o.Hydrate([]Span{{0, 4 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	st := waitHydrated(t, h, 30*time.Second)
	took := time.Since(start)
	if st.State != "complete" || took < 3200*time.Millisecond || st.Rate > opts.HydrateRate*12/10 {
		t.Errorf("4 MiB at a cap of 1 MiB/s: %+v in %v; want at least 3.2 s, a rate within 20 %% of the cap", st, took)
	}

	opts.HydrateRate = 0
	opts.CacheDir = t.TempDir()
	c = newClient(t, opts)
	o = open(t, c, ng.URL+"/disk.img")
	start = time.Now()
	h, err = o.Hydrate([]Span{{0, 4 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	if st := waitHydrated(t, h, 30*time.Second); st.State != "complete" || time.Since(start) > 2*time.Second {
		t.Errorf("4 MiB without a cap over loopback: %+v in %v", st, time.Since(start))
	}
}

// TestHydrateSkipsWhatReadersFetched: a chunk a reader fetched while a
// capped hydration's run holding it waited its turn is in the disk cache
// when the run's turn comes, and is not fetched again: nginx's log shows
// each chunk of the object fetched once. (The object takes 2 s at the
// cap; the reader's fetch takes a moment at the start.)
func TestHydrateSkipsWhatReadersFetched(t *testing.T) {
	const size = 2 << 20
	ng, data := nginxWith(t, size, false)
	opts := testOptions(nil)
	opts.CacheDir = t.TempDir()
	opts.ChunkSize, opts.MaxRequest = 64<<10, 256<<10
	opts.HydrateRate = 1 << 20
	c := newClient(t, opts)
	o := open(t, c, ng.URL+"/disk.img")
	ng.WaitLog(t, 1)
	h, err := o.Hydrate([]Span{{0, size}})
	if err != nil {
		t.Fatal(err)
	}
	// Chunk 14 is in the fourth run of four chunks: the fourth worker
	// took it at once, and waits 0.75 s for its turn.
	p := make([]byte, 4096)
	off := int64(14<<16 + 100)
	if _, err := o.ReadAt(p, off); err != nil || !bytes.Equal(p, data[off:off+4096]) {
		t.Fatalf("read at %d: %v", off, err)
	}
	if st := waitHydrated(t, h, 30*time.Second); st.State != "complete" || st.Done != size {
		t.Fatalf("hydration: %+v", st)
	}
	fetched := map[int64]int{}
	for _, a := range ng.WaitBodyBytes(t, size) { // Open's request (the first chunk) too
		lo, hi := parseRange(t, a.Range)
		for q := lo; q < hi; q += opts.ChunkSize {
			fetched[q/opts.ChunkSize]++
		}
	}
	for idx := range int64(size / opts.ChunkSize) {
		if fetched[idx] != 1 {
			t.Errorf("chunk %d fetched %d times, want once", idx, fetched[idx])
		}
	}
}

// TestHydrateBounded: spans larger than the disk cache's bound are
// hydrated up to it, lowest offsets first; the status says "bounded" and
// the log says so in a line.
func TestHydrateBounded(t *testing.T) {
	ng, _ := nginxWith(t, 8<<20, false)
	var log logBuf
	opts := testOptions(&log)
	opts.CacheDir = t.TempDir()
	opts.CacheDirSize = 2 << 20
	c := newClient(t, opts)
	o := open(t, c, ng.URL+"/disk.img")
	h, err := o.Hydrate([]Span{{0, 8 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	st := waitHydrated(t, h, 30*time.Second)
	if st.State != "bounded" || st.Done == 0 || st.Done > opts.CacheDirSize || st.Needed != 8<<20 {
		t.Errorf("hydration past the bound: %+v; want bounded, done within %d", st, opts.CacheDirSize)
	}
	if log.count("hydration stopped at the disk cache's bound") != 1 {
		t.Errorf("no log line about the bound:\n%s", log.String())
	}
	for _, a := range ng.Log(t)[1:] {
		if lo, _ := parseRange(t, a.Range); lo >= opts.CacheDirSize {
			t.Errorf("fetched %s: past the bound, where lower chunks come first", a.Range)
		}
	}
}
