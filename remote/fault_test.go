package remote

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/servers"
)

// TestFaults puts a fault proxy between a Client and nginx and reads a
// range of six uncached chunks under each fault: transient faults that
// stop are retried and the bytes are right; faults that persist fail the
// read with the error named, within the timeout, never hanging.
func TestFaults(t *testing.T) {
	ng, data := nginxWith(t, 2<<20, false)
	px := servers.NewFaultProxy(t, ng.URL)
	for _, c := range []struct {
		name    string
		fault   servers.Fault
		wantErr error         // nil: the read succeeds
		retries bool          // the read needed retries
		minTime time.Duration // the read takes at least this long
		says    string        // the error says this
		timeout time.Duration // Options.Timeout; default 1 s
	}{
		{name: "503 twice", fault: servers.Fault{Kind: servers.Status, Count: 2}, retries: true},
		{name: "500 always", fault: servers.Fault{Kind: servers.Status, Status: 500}, wantErr: ErrTimeout, says: "status 500"},
		{name: "503 always", fault: servers.Fault{Kind: servers.Status}, wantErr: ErrTimeout, says: "status 503"},
		{name: "429 with Retry-After 1", fault: servers.Fault{Kind: servers.Status, Status: 429, RetryAfter: 1, Count: 1}, retries: true, minTime: time.Second, timeout: 3 * time.Second},
		{name: "connection dropped mid-body twice", fault: servers.Fault{Kind: servers.Drop, After: 30000, Count: 2}, retries: true},
		{name: "connection dropped mid-body always", fault: servers.Fault{Kind: servers.Drop, After: 1000}, wantErr: ErrTimeout, says: "body cut"},
		{name: "stall once", fault: servers.Fault{Kind: servers.Stall, Count: 1}, retries: true, minTime: 300 * time.Millisecond},
		{name: "stall always", fault: servers.Fault{Kind: servers.Stall}, wantErr: ErrTimeout, says: "no byte received"},
		{name: "short body once", fault: servers.Fault{Kind: servers.ShortBody, After: 5000, Count: 1}, retries: true},
		{name: "short body always", fault: servers.Fault{Kind: servers.ShortBody, After: 5000}, wantErr: ErrTimeout, says: "short body"},
		{name: "range ignored", fault: servers.Fault{Kind: servers.IgnoreRange}, wantErr: ErrNoRange, says: "status 200"},
		{name: "403", fault: servers.Fault{Kind: servers.Status, Status: 403}, wantErr: ErrAuth, says: "status 403"},
	} {
		t.Run(strings.ReplaceAll(c.name, " ", "_"), func(t *testing.T) {
			opts := testOptions(nil)
			opts.Timeout = cmp.Or(c.timeout, time.Second)
			opts.StallTimeout = 300 * time.Millisecond
			cl := newClient(t, opts)
			o := open(t, cl, px.URL+"/disk.img")
			px.Set(c.fault)
			defer px.Clear()
			off, n := 3*opts.ChunkSize+17, 6*opts.ChunkSize
			p := make([]byte, n)
			var (
				got int
				err error
			)
			start := time.Now()
			within(t, opts.Timeout+2*time.Second, "the read", func() { got, err = o.ReadAt(p, off) })
			elapsed := time.Since(start)
			st := o.Stats()
			if c.wantErr == nil {
				if err != nil {
					t.Fatalf("read: %v (stats %+v)", err, st)
				}
				if !bytes.Equal(p, data[off:off+n]) {
					t.Fatal("bytes differ from the file")
				}
				if c.retries && st.Retries == 0 {
					t.Errorf("no retry counted: %+v", st)
				}
			} else {
				if !errors.Is(err, c.wantErr) || got != 0 {
					t.Fatalf("read = %d, %v; want 0, %v", got, err, c.wantErr)
				}
				if !strings.Contains(err.Error(), c.says) || !strings.Contains(err.Error(), "/disk.img") {
					t.Errorf("error %q does not name the URL and %q", err, c.says)
				}
				if c.wantErr != ErrTimeout && elapsed > opts.Timeout/2 {
					t.Errorf("a permanent failure took %v: it must not be retried", elapsed)
				}
			}
			if elapsed < c.minTime {
				t.Errorf("read took %v, want at least %v", elapsed, c.minTime)
			}
			// The fault gone, the object reads again (unless refused):
			// after a timeout, once its probe finds the server
			// answering (health.go).
			px.Clear()
			px.Release()
			if c.wantErr != ErrNoRange {
				deadline := time.Now().Add(3 * time.Second)
				for {
					_, err := o.ReadAt(p, off)
					if err == nil && bytes.Equal(p, data[off:off+n]) {
						break
					}
					if c.wantErr != ErrTimeout || time.Now().After(deadline) {
						t.Errorf("read after the fault cleared: %v", err)
						break
					}
					time.Sleep(10 * time.Millisecond)
				}
			}
		})
	}
}

// TestDropResumes: a body cut mid-way is resumed where it stopped, not
// fetched again from the start.
func TestDropResumes(t *testing.T) {
	ng, data := nginxWith(t, 1<<20, false)
	px := servers.NewFaultProxy(t, ng.URL)
	opts := testOptions(nil)
	o := open(t, newClient(t, opts), px.URL+"/disk.img")
	px.Set(servers.Fault{Kind: servers.Drop, After: 10000, Count: 1})
	cs := opts.ChunkSize
	p := make([]byte, cs)
	if _, err := o.ReadAt(p, 2*cs); err != nil || !bytes.Equal(p, data[2*cs:3*cs]) {
		t.Fatalf("read: %v", err)
	}
	log := ng.WaitLog(t, 3)
	got := rangesAfter(log, 1)
	want := []string{fmt.Sprintf("bytes=%d-%d", 2*cs, 3*cs-1), fmt.Sprintf("bytes=%d-%d", 2*cs+10000, 3*cs-1)}
	if len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Errorf("ranges %q, want %q", got, want)
	}
}

// TestNoRangeAtOpen: a server that ignores Range is refused at Open, after
// receiving a small part of the body only (the connection is closed).
func TestNoRangeAtOpen(t *testing.T) {
	const size = 64 << 20
	ng, _ := nginxWith(t, size, false)
	px := servers.NewFaultProxy(t, ng.URL)
	px.Set(servers.Fault{Kind: servers.IgnoreRange})
	c := newClient(t, testOptions(nil))
	var err error
	within(t, 5*time.Second, "open", func() { _, err = c.Open(context.Background(), px.URL+"/disk.img") })
	if !errors.Is(err, ErrNoRange) || !strings.Contains(err.Error(), "status 200") {
		t.Fatalf("open: %v; want ErrNoRange", err)
	}
	if c.Stats().Retries != 0 {
		t.Errorf("ErrNoRange was retried")
	}
	// The proxy stops writing once the closed connection's buffers fill.
	waitFor(t, 5*time.Second, "the proxy to finish", func() bool {
		log := ng.Log(t)
		return len(log) == 1
	})
	if sent := px.BodyBytes(); sent > size/4 {
		t.Errorf("%d of %d body bytes went out for a refused Open", sent, size)
	}
}

// replace rewrites the file with other bytes, of the same size or not,
// and a new modification time, so nginx's ETag (mtime-size) changes.
func replace(t testing.TB, path string, size int, seed uint64) {
	t.Helper()
	data := writeRandom(t, filepath.Dir(path), filepath.Base(path), size, seed)
	_ = data
	future := time.Now().Add(time.Hour)
	if err := os.Chtimes(path, future, future); err != nil {
		t.Fatal(err)
	}
}

// TestChanged: an object replaced while open fails every read from then on
// with ErrChanged, cached chunks included, and logs one line; no read
// returns bytes of the new version.
func TestChanged(t *testing.T) {
	for _, c := range []struct {
		name     string
		newSize  int
		viaProxy servers.FaultKind // StripIfMatch: a server ignoring If-Match
	}{
		{"same size", 1 << 20, servers.Pass},
		{"grown", 1<<20 + 4096, servers.Pass},
		{"If-Match ignored", 1 << 20, servers.StripIfMatch},
	} {
		t.Run(strings.ReplaceAll(c.name, " ", "_"), func(t *testing.T) {
			ng, data := nginxWith(t, 1<<20, false)
			px := servers.NewFaultProxy(t, ng.URL)
			px.Set(servers.Fault{Kind: c.viaProxy})
			var log logBuf
			opts := testOptions(&log)
			o := open(t, newClient(t, opts), px.URL+"/disk.img")
			cs := opts.ChunkSize
			p := make([]byte, cs)
			if _, err := o.ReadAt(p, cs); err != nil || !bytes.Equal(p, data[cs:2*cs]) {
				t.Fatalf("read before the change: %v", err)
			}
			replace(t, filepath.Join(ng.Root, "disk.img"), c.newSize, 99)
			var wg sync.WaitGroup
			for i := range 4 {
				wg.Go(func() {
					q := make([]byte, 1000)
					off := int64(5+i) * cs
					n, err := o.ReadAt(q, off)
					if !errors.Is(err, ErrChanged) || n != 0 {
						t.Errorf("read of an uncached chunk after the change: %d, %v; want ErrChanged", n, err)
					}
				})
			}
			wg.Wait()
			if n, err := o.ReadAt(p, cs); !errors.Is(err, ErrChanged) || n != 0 {
				t.Errorf("read of a cached chunk after the change: %d, %v; want ErrChanged", n, err)
			}
			if n := log.count("changed while open"); n != 1 {
				t.Errorf("%d log lines about the change, want 1:\n%s", n, log.String())
			}
			if c.viaProxy == servers.StripIfMatch {
				for _, a := range ng.Log(t)[1:] {
					if a.IfMatch != "" {
						t.Errorf("request with If-Match %q reached nginx through the stripping proxy", a.IfMatch)
					}
				}
			}
		})
	}
}

// TestRedacted: credentials in a URL, as userinfo or signed query, show in
// no error, log line or Object.URL.
func TestRedacted(t *testing.T) {
	ng, _ := nginxWith(t, 1<<20, false)
	px := servers.NewFaultProxy(t, ng.URL)
	var log logBuf
	opts := testOptions(&log)
	opts.Timeout = time.Second
	c := newClient(t, opts)
	secrets := []string{"hunter2", "SIGsecret", "CREDsecret"}
	host := strings.TrimPrefix(px.URL, "http://")
	check := func(what, s string) {
		for _, sec := range secrets {
			if strings.Contains(s, sec) {
				t.Errorf("%s shows %q: %s", what, sec, s)
			}
		}
	}
	q := "?X-Amz-Signature=SIGsecret&X-Amz-Credential=CREDsecret"
	o := open(t, c, "http://alice:hunter2@"+host+"/disk.img"+q)
	check("URL()", o.URL())
	_, err := c.Open(context.Background(), "http://alice:hunter2@"+host+"/missing.img"+q)
	if !errors.Is(err, ErrNotFound) {
		t.Errorf("open of a missing file: %v; want ErrNotFound", err)
	}
	check("open error", err.Error())
	px.Set(servers.Fault{Kind: servers.Status})
	_, err = o.ReadAt(make([]byte, 100), 500000)
	check("read error", err.Error())
	px.Set(servers.Fault{Kind: servers.Status, Status: 401})
	_, err = c.Open(context.Background(), "http://alice:hunter2@"+host+"/disk.img"+q)
	if !errors.Is(err, ErrAuth) {
		t.Errorf("open refused with 401: %v; want ErrAuth", err)
	}
	check("auth error", err.Error())
	check("log", log.String())
	if !strings.Contains(log.String(), "retrying") {
		t.Errorf("no retry was logged, so the log check proves little:\n%s", log.String())
	}
}
