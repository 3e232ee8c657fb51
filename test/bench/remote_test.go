package main

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

// The delaying proxy adds its round trip to every request and counts the
// bytes the server sent, and passes them on unchanged.
func TestDelayProxy(t *testing.T) {
	body := bytes.Repeat([]byte("0123456789abcdef"), 1<<16) // 1 MiB
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write(body)
	}))
	defer srv.Close()
	target := srv.Listener.Addr().String()
	for _, rtt := range []time.Duration{0, 40 * time.Millisecond} {
		p, err := newDelayProxy(target, rtt/2)
		if err != nil {
			t.Fatal(err)
		}
		client := &http.Client{Transport: &http.Transport{}}
		get := func() time.Duration {
			t0 := time.Now()
			resp, err := client.Get("http://" + p.addr + "/")
			if err != nil {
				t.Fatal(err)
			}
			got, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, body) {
				t.Fatalf("rtt %v: the body came through changed (%d bytes, want %d)", rtt, len(got), len(body))
			}
			return time.Since(t0)
		}
		first := get()  // a new connection: handshake and request
		second := get() // the same connection again: one round trip
		if first < 2*rtt || second < rtt {
			t.Errorf("rtt %v: requests took %v (new connection) and %v (kept), want at least %v and %v", rtt, first, second, 2*rtt, rtt)
		}
		if rtt > 0 && second > rtt+time.Second {
			t.Errorf("rtt %v: a kept connection's request took %v", rtt, second)
		}
		client.CloseIdleConnections()
		p.close()
		if n := p.sent.Load(); n < 2*int64(len(body)) || n > 2*int64(len(body))+4096 {
			t.Errorf("rtt %v: counted %d bytes from the server, want two bodies of %d and their headers", rtt, n, len(body))
		}
		if c := p.conns.Load(); c != 1 {
			t.Errorf("rtt %v: %d connections, want 1 (kept alive)", rtt, c)
		}
	}
}
