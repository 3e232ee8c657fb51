package remote

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/servers"
)

// rangesAfter returns the Range headers of the GETs logged after the
// first skip requests.
func rangesAfter(log []servers.Access, skip int) []string {
	var r []string
	for _, a := range log[skip:] {
		r = append(r, a.Range)
	}
	return r
}

// waitFor polls cond until it holds, failing the test after d.
func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// TestSpanningRead: one read over ten missing chunks is split into range
// requests of at most MaxRequest (four chunks), all in flight at once,
// that fetch exactly the chunks needed.
func TestSpanningRead(t *testing.T) {
	ng, data := nginxWith(t, 2<<20, false)
	px := servers.NewFaultProxy(t, ng.URL)
	opts := testOptions(nil)
	opts.StallTimeout = 5 * time.Second
	c := newClient(t, opts)
	o := open(t, c, px.URL+"/disk.img")
	cs := opts.ChunkSize
	off, n := 2*cs+100, 10*cs-200 // chunks 2 to 11
	px.Set(servers.Fault{Kind: servers.Stall})
	p := make([]byte, n)
	done := make(chan error, 1)
	go func() { _, err := o.ReadAt(p, off); done <- err }()
	waitFor(t, 5*time.Second, "3 requests in flight", func() bool { return px.Held() == 3 })
	px.Clear()
	px.Release()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("read hung")
	}
	if !bytes.Equal(p, data[off:off+n]) {
		t.Fatal("bytes differ")
	}
	got := rangesAfter(ng.WaitLog(t, 4), 1)
	slices.Sort(got)
	want := []string{
		fmt.Sprintf("bytes=%d-%d", 10*cs, 12*cs-1),
		fmt.Sprintf("bytes=%d-%d", 2*cs, 6*cs-1),
		fmt.Sprintf("bytes=%d-%d", 6*cs, 10*cs-1),
	}
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("range requests %q, want %q", got, want)
	}
}

// TestSingleFetch: readers of a chunk being fetched wait for that fetch
// rather than send their own request.
func TestSingleFetch(t *testing.T) {
	ng, data := nginxWith(t, 1<<20, false)
	px := servers.NewFaultProxy(t, ng.URL)
	opts := testOptions(nil)
	opts.StallTimeout = 5 * time.Second
	opts.Timeout = 10 * time.Second
	c := newClient(t, opts)
	o := open(t, c, px.URL+"/disk.img")
	before := px.Requests()
	px.Set(servers.Fault{Kind: servers.Stall})
	const readers = 8
	cs := opts.ChunkSize
	var wg sync.WaitGroup
	errs := make(chan error, readers)
	read := func(i int) {
		off := 3*cs + int64(i)*1000
		p := make([]byte, 4000)
		if _, err := o.ReadAt(p, off); err != nil {
			errs <- err
		} else if !bytes.Equal(p, data[off:off+4000]) {
			errs <- fmt.Errorf("reader %d: bytes differ", i)
		}
	}
	wg.Go(func() { read(0) })
	waitFor(t, 5*time.Second, "the first fetch", func() bool { return px.Held() == 1 })
	for i := 1; i < readers; i++ {
		wg.Go(func() { read(i) })
	}
	waitFor(t, 5*time.Second, "7 readers waiting", func() bool { return o.Stats().Waits == readers-1 || px.Held() > 1 })
	px.Clear()
	px.Release()
	within(t, 10*time.Second, "readers", wg.Wait)
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	// Count the requests for chunk 3 (readers further on may prefetch
	// chunk 4).
	log := ng.WaitLog(t, int(px.Requests()))
	n := 0
	for _, r := range rangesAfter(log, int(before)) {
		var lo, hi int64
		fmt.Sscanf(r, "bytes=%d-%d", &lo, &hi)
		if lo <= 3*cs && hi >= 3*cs {
			n++
		}
	}
	if n != 1 {
		t.Errorf("%d requests for one chunk read by %d readers at once, want 1", n, readers)
	}
}

// TestReadahead: a sequential reader gets growing prefetches, so a scan
// in small reads costs a few large requests; random readers cause no
// prefetch and fetch no more than the chunks they touch.
func TestReadahead(t *testing.T) {
	const size = 16 << 20
	ng, data := nginxWith(t, size, false)
	opts := testOptions(nil)
	c := newClient(t, opts)
	o := open(t, c, ng.URL+"/disk.img")
	chunks := int64(size / opts.ChunkSize)
	if !bytes.Equal(readAll(t, o, 16<<10), data) {
		t.Fatal("sequential read differs")
	}
	st := o.Stats()
	t.Logf("sequential scan of %d chunks in 16 KiB reads: %+v", chunks, st)
	if st.Prefetched == 0 {
		t.Errorf("no prefetch for a sequential scan: %+v", st)
	}
	if st.Requests > chunks/3 {
		t.Errorf("%d requests for a scan of %d chunks: readahead should batch them", st.Requests, chunks)
	}
	if st.Bytes > size {
		t.Errorf("%d bytes fetched for a %d byte file", st.Bytes, size)
	}

	o2 := open(t, newClient(t, opts), ng.URL+"/disk.img")
	r := rand.New(rand.NewPCG(5, 6))
	p := make([]byte, 4096)
	const reads = 40
	for range reads {
		off := r.Int64N(size - 4096)
		if _, err := o2.ReadAt(p, off); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(p, data[off:off+4096]) {
			t.Fatalf("random read at %d differs", off)
		}
	}
	st = o2.Stats()
	if st.Prefetched != 0 || st.Bytes > reads*2*opts.ChunkSize {
		t.Errorf("random 4 KiB reads: %d chunks prefetched, %d bytes fetched for %d reads", st.Prefetched, st.Bytes, reads)
	}
}

// TestDiskCache: a second Client with the same CacheDir reads what the
// first fetched without a request; the folder stays within CacheDirSize;
// a damaged chunk file is dropped and fetched again.
func TestDiskCache(t *testing.T) {
	const size = 1<<20 + 3000
	ng, data := nginxWith(t, size, false)
	dir := t.TempDir()
	opts := testOptions(nil)
	opts.CacheDir = dir
	o1 := open(t, newClient(t, opts), ng.URL+"/disk.img")
	if !bytes.Equal(readAll(t, o1, 64<<10), data) {
		t.Fatal("first read differs")
	}
	o1.Close()

	var log logBuf
	opts2 := testOptions(&log)
	opts2.CacheDir = dir
	c2 := newClient(t, opts2)
	o2 := open(t, c2, ng.URL+"/disk.img")
	if !bytes.Equal(readAll(t, o2, 64<<10), data) {
		t.Fatal("read from the disk cache differs")
	}
	if st := o2.Stats(); st.Requests != 0 || st.DiskHits == 0 {
		t.Errorf("second client: %+v; want every chunk from disk, no request", st)
	}
	o2.Close()

	// Damage one chunk file: it must be dropped, and fetched again.
	var files []string
	walkFiles(t, dir, func(path string, size int64) { files = append(files, path) })
	if len(files) == 0 {
		t.Fatal("no chunk files in the cache dir")
	}
	damage(t, files[len(files)/2])
	c3 := newClient(t, opts2)
	o3 := open(t, c3, ng.URL+"/disk.img")
	if !bytes.Equal(readAll(t, o3, 64<<10), data) {
		t.Fatal("read with a damaged cache file differs")
	}
	if st := o3.Stats(); st.Requests == 0 || !strings.Contains(log.String(), "damaged") {
		t.Errorf("a damaged chunk file was not noticed: %+v", st)
	}

	// A small bound: the folder never holds more.
	small := t.TempDir()
	opts4 := testOptions(nil)
	opts4.CacheDir, opts4.CacheDirSize = small, 5*(opts4.ChunkSize+64)
	c4 := newClient(t, opts4)
	o4 := open(t, c4, ng.URL+"/disk.img")
	readAll(t, o4, 64<<10)
	o4.Close() // waits for the fetches, and so for their chunk files
	var total int64
	walkFiles(t, small, func(_ string, size int64) { total += size })
	if total > opts4.CacheDirSize || total == 0 {
		t.Errorf("cache dir holds %d bytes, bound %d", total, opts4.CacheDirSize)
	}
	_ = context.Background
}

// TestReadaheadWaitsForConnections: a readahead window of many requests,
// two connections, and a server 5 ms away (a delaying proxy: simulated
// latency). Prefetches wait for a connection rather than being dropped, so
// a sequential scan costs one request per MaxRequest bytes, and the
// reader never fetches chunks itself that readahead had asked for.
func TestReadaheadWaitsForConnections(t *testing.T) {
	const size = 16 << 20
	ng, data := nginxWith(t, size, false)
	px := servers.NewFaultProxy(t, ng.URL)
	px.Set(servers.Fault{Kind: servers.Delay, Delay: 5 * time.Millisecond})
	opts := testOptions(nil)
	opts.Connections = 2
	opts.MaxReadahead = 2 << 20 // 8 requests of 256 KiB
	c := newClient(t, opts)
	o := open(t, c, px.URL+"/disk.img")
	if !bytes.Equal(readAll(t, o, 128<<10), data) {
		t.Fatal("sequential read differs")
	}
	st := o.Stats()
	t.Logf("sequential scan, 2 connections, 2 MiB window: %+v", st)
	if st.Dropped != 0 {
		t.Errorf("%d prefetches dropped", st.Dropped)
	}
	// One request per MaxRequest, give or take the first reads (before
	// the stream is seen) and runs cut where a window step ends.
	if most := 2 * size / opts.MaxRequest; st.Requests > most {
		t.Errorf("%d requests for %d bytes; at most %d expected with %d-byte requests", st.Requests, size, most, opts.MaxRequest)
	}
}

// TestScanKeepsEarlierChunks: a sequential scan through a cache smaller
// than the object reuses the slots of the chunks it has read past, not
// those of chunks another reader fetched earlier and the scan has yet to
// reach. This is cp of a sparse remote image: qcowfs counts the image's
// data in the background (an L2 table read in each chunk it touches, the
// rest of the chunk being the data the copy reads next), while cp
// streams through the data; with the scan's chunks kept, the count's were
// evicted and fetched a second time. Every chunk must be fetched once.
func TestScanKeepsEarlierChunks(t *testing.T) {
	const size = 16 << 20
	ng, data := nginxWith(t, size, false)
	opts := testOptions(nil)
	opts.CacheSize = 4 << 20 // 64 chunks, a quarter of the object
	c := newClient(t, opts)
	o := open(t, c, ng.URL+"/disk.img")
	cs := opts.ChunkSize
	// The earlier reader: 4 KiB in every 16th chunk, 15 chunks.
	p := make([]byte, 4096)
	for off := int64(1 << 20); off < size; off += 1 << 20 {
		if _, err := o.ReadAt(p, off+100); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(p, data[off+100:off+100+4096]) {
			t.Fatalf("read at %d differs", off+100)
		}
	}
	// Open fetched the first chunk (counted for the Client only).
	if st := c.Stats(); st.Bytes != 16*cs {
		t.Fatalf("opening and the isolated reads fetched %d bytes, want %d: %+v", st.Bytes, 16*cs, st)
	}
	if !bytes.Equal(readAll(t, o, int(cs)), data) {
		t.Fatal("sequential read differs")
	}
	st := c.Stats()
	t.Logf("isolated reads, then a scan of %d chunks through a cache of %d: %+v", size/cs, opts.CacheSize/cs, st)
	if st.Bytes != size {
		t.Errorf("%d bytes fetched for a %d byte object (%.3fx): chunks were fetched twice", st.Bytes, size, float64(st.Bytes)/size)
	}
}

// TestReadaheadKeepsWindowFull: a sequential reader, once its window is
// at MaxReadahead, always has all of it but one request's worth asked for
// ahead of it, asked for a request at a time once the window has grown
// (prefetch cuts what it asks for into runs of MaxRequest). (Half-window steps let the
// prefetched distance fall to half the window, and then asked for the
// other half at once: a reader as fast as the link waited at every step.)
func TestReadaheadKeepsWindowFull(t *testing.T) {
	opts, err := Options{}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	cs := opts.ChunkSize
	o := &Object{c: &Client{opts: opts}, nchunks: (1 << 30) / cs}
	maxWin, step := opts.MaxReadahead/cs, opts.MaxRequest/cs
	var ahead int64 // chunks before this one have been asked for
	full := false
	for off := int64(0); off < o.nchunks*cs; off += 128 << 10 {
		end := off + 128<<10
		from, to, _, _ := o.ra.advise(off, end, o)
		last := (end - 1) / cs
		if from < to {
			if from != max(ahead, last+1) {
				t.Fatalf("read at %d: prefetch from chunk %d, want %d", off, from, max(ahead, last+1))
			}
			if full && to-from > step {
				t.Fatalf("read at %d: prefetch of %d chunks at once, want at most a request (%d)", off, to-from, step)
			}
			ahead = to
		}
		ahead = max(ahead, last+1)
		if ahead-(last+1) >= maxWin-step {
			full = true
		}
		if full && ahead < o.nchunks && ahead-(last+1) < maxWin-step {
			t.Fatalf("read at %d: %d chunks asked for ahead of the reader, want at least %d of the %d-chunk window",
				off, ahead-(last+1), maxWin-step, maxWin)
		}
	}
	if !full {
		t.Fatal("the window never reached MaxReadahead")
	}
}
