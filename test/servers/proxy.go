package servers

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// FaultKind is what a FaultProxy does to a request.
type FaultKind int

const (
	Pass         FaultKind = iota // forward unchanged
	Status                        // answer Fault.Status (default 503) without forwarding
	Drop                          // forward; close the connection after Fault.After body bytes
	Stall                         // hold the request, no response, until the client gives up or Release
	IgnoreRange                   // forward without Range (the server sends the whole body)
	ShortBody                     // forward; send only Fault.After body bytes, with a Content-Length that says so
	StripIfMatch                  // forward without If-Match (a server ignoring the condition)
	Delay                         // wait Fault.Delay, then forward
)

func (k FaultKind) String() string {
	return [...]string{"pass", "status", "drop", "stall", "ignore-range", "short-body", "strip-if-match", "delay"}[k]
}

// A Fault says what to do to the requests it matches.
type Fault struct {
	Kind       FaultKind
	Status     int                      // for Status; 503 if 0
	RetryAfter int                      // for Status: a Retry-After header, in seconds, if > 0
	Body       string                   // for Status: the body (e.g. an S3 error document); default a line of text
	After      int64                    // for Drop and ShortBody: body bytes sent first
	Delay      time.Duration            // for Delay
	Rate       int64                    // for Delay: if > 0, each response's body is sent at most this many bytes a second
	Count      int                      // requests to apply it to, then Pass; 0: every request
	Match      func(*http.Request) bool // which requests; nil: all
}

// FaultProxy is an HTTP proxy on 127.0.0.1 in front of one server that
// applies a switchable Fault. It forwards the Host header unchanged, so
// S3 signatures made for the proxy's address stay valid.
type FaultProxy struct {
	URL    string // http://127.0.0.1:PORT
	target *url.URL
	tr     *http.Transport
	srv    *http.Server

	mu      sync.Mutex
	fault   Fault
	left    int           // requests the fault still applies to, with Count > 0
	release chan struct{} // closed by Release, then replaced

	requests, faulted, bodyBytes atomic.Int64
	held                         atomic.Int32
}

// NewFaultProxy starts a proxy to target (http://host:port), passing
// everything until Set; it is stopped when the test ends.
func NewFaultProxy(t testing.TB, target string) *FaultProxy {
	t.Helper()
	u, err := url.Parse(target)
	if err != nil || u.Scheme != "http" || u.Host == "" {
		t.Fatalf("fault proxy: target %q: want http://host:port", target)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &FaultProxy{
		URL:     "http://" + l.Addr().String(),
		target:  u,
		tr:      &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: 64},
		release: make(chan struct{}),
	}
	p.srv = &http.Server{Handler: p, ErrorLog: nil}
	go p.srv.Serve(l)
	t.Cleanup(func() {
		p.Release()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		p.srv.Shutdown(ctx)
		p.srv.Close()
		p.tr.CloseIdleConnections()
	})
	return p
}

// Set makes f the fault applied from the next request on.
func (p *FaultProxy) Set(f Fault) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.fault, p.left = f, f.Count
}

// Clear stops injecting faults (requests held by Stall stay held until
// Release or their client gives up).
func (p *FaultProxy) Clear() { p.Set(Fault{}) }

// Release lets the requests that Stall holds now proceed; later ones are
// held again while the fault lasts.
func (p *FaultProxy) Release() {
	p.mu.Lock()
	defer p.mu.Unlock()
	close(p.release)
	p.release = make(chan struct{})
}

// Requests is the number of requests received; Faulted, how many got a
// fault; Held, how many Stall holds now; BodyBytes, the response body bytes
// sent to clients.
func (p *FaultProxy) Requests() int64  { return p.requests.Load() }
func (p *FaultProxy) Faulted() int64   { return p.faulted.Load() }
func (p *FaultProxy) Held() int        { return int(p.held.Load()) }
func (p *FaultProxy) BodyBytes() int64 { return p.bodyBytes.Load() }

// paced copies body to w at most rate bytes a second, in pieces of up
// to 16 KiB: the link of a given bandwidth that Fault.Rate stands for,
// each response with a link of its own.
func paced(w http.ResponseWriter, body io.Reader, rate int64) (int64, error) {
	start := time.Now()
	buf := make([]byte, 16<<10)
	var n int64
	for {
		if d := time.Duration(float64(n)/float64(rate)*float64(time.Second)) - time.Since(start); d > 0 {
			time.Sleep(d)
		}
		k, rerr := body.Read(buf)
		if k > 0 {
			if _, err := w.Write(buf[:k]); err != nil {
				return n, err
			}
			n += int64(k)
		}
		if rerr == io.EOF {
			return n, nil
		}
		if rerr != nil {
			return n, rerr
		}
	}
}

// take returns the fault for r, counting it down.
func (p *FaultProxy) take(r *http.Request) (Fault, <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	f := p.fault
	if f.Kind == Pass || (f.Match != nil && !f.Match(r)) {
		return Fault{}, p.release
	}
	if f.Count > 0 {
		if p.left == 0 {
			return Fault{}, p.release
		}
		p.left--
	}
	return f, p.release
}

var hopHeaders = []string{"Connection", "Keep-Alive", "Proxy-Connection", "Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade"}

func (p *FaultProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p.requests.Add(1)
	f, release := p.take(r)
	if f.Kind != Pass {
		p.faulted.Add(1)
	}
	switch f.Kind {
	case Status:
		code := f.Status
		if code == 0 {
			code = http.StatusServiceUnavailable
		}
		if f.RetryAfter > 0 {
			w.Header().Set("Retry-After", strconv.Itoa(f.RetryAfter))
		}
		if f.Body != "" {
			w.Header().Set("Content-Type", "application/xml")
			w.WriteHeader(code)
			io.WriteString(w, f.Body)
			return
		}
		http.Error(w, fmt.Sprintf("fault proxy: status %d", code), code)
		return
	case Stall:
		p.held.Add(1)
		select {
		case <-release:
			p.held.Add(-1)
		case <-r.Context().Done():
			p.held.Add(-1)
			return
		}
	case Delay:
		select {
		case <-time.After(f.Delay):
		case <-r.Context().Done():
			return
		}
	}
	out := r.Clone(r.Context())
	out.RequestURI = ""
	out.URL.Scheme, out.URL.Host = p.target.Scheme, p.target.Host
	out.Host = r.Host
	for _, h := range hopHeaders {
		out.Header.Del(h)
	}
	switch f.Kind {
	case IgnoreRange:
		out.Header.Del("Range")
	case StripIfMatch:
		out.Header.Del("If-Match")
	}
	resp, err := p.tr.RoundTrip(out)
	if err != nil {
		if r.Context().Err() == nil {
			http.Error(w, "fault proxy: "+err.Error(), http.StatusBadGateway)
		}
		return
	}
	defer resp.Body.Close()
	for k, v := range resp.Header {
		w.Header()[k] = v
	}
	for _, h := range hopHeaders {
		w.Header().Del(h)
	}
	body := io.Reader(resp.Body)
	switch f.Kind {
	case ShortBody:
		if resp.ContentLength > f.After {
			w.Header().Set("Content-Length", strconv.FormatInt(f.After, 10))
			body = io.LimitReader(resp.Body, f.After)
		}
	case Drop:
		body = io.LimitReader(resp.Body, f.After)
	}
	w.WriteHeader(resp.StatusCode)
	var n int64
	if f.Kind == Delay && f.Rate > 0 {
		n, err = paced(w, body, f.Rate)
	} else {
		n, err = io.Copy(w, body)
	}
	p.bodyBytes.Add(n)
	if (f.Kind == Drop && resp.ContentLength > f.After) || (err != nil && !errors.Is(err, io.EOF)) {
		// Cut the connection with the response unfinished.
		http.NewResponseController(w).Flush()
		panic(http.ErrAbortHandler)
	}
}
