package remote

import (
	"bytes"
	"context"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/servers"
)

// logBuf collects a Client's log lines, safe for concurrent writers.
type logBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// count returns the lines that contain s.
func (l *logBuf) count(s string) int {
	n := 0
	for line := range strings.SplitSeq(l.String(), "\n") {
		if strings.Contains(line, s) {
			n++
		}
	}
	return n
}

// testOptions are small: 64 KiB chunks, quick retries. The timeout is
// generous (a loaded machine running -race is slow); tests of timeouts set
// their own.
func testOptions(log *logBuf) Options {
	o := Options{
		ChunkSize:    64 << 10,
		MaxRequest:   256 << 10,
		MaxReadahead: 1 << 20,
		CacheSize:    8 << 20,
		Timeout:      10 * time.Second,
		StallTimeout: 2 * time.Second,
		RetryBase:    10 * time.Millisecond,
		RetryMax:     100 * time.Millisecond,
	}
	if log != nil {
		o.Log = slog.New(slog.NewTextHandler(log, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return o
}

func newClient(t testing.TB, o Options) *Client {
	t.Helper()
	c, err := NewClient(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// writeRandom writes size random bytes (seeded: a failure reproduces) to
// dir/name and returns them.
func writeRandom(t testing.TB, dir, name string, size int, seed uint64) []byte {
	t.Helper()
	data := make([]byte, size)
	r := rand.New(rand.NewPCG(seed, 1))
	for i := 0; i+8 <= size; i += 8 {
		v := r.Uint64()
		for j := range 8 {
			data[i+j] = byte(v >> (8 * j))
		}
	}
	for i := size &^ 7; i < size; i++ {
		data[i] = byte(r.Uint32())
	}
	path := filepath.Join(dir, name)
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return data
}

// open opens url, failing the test on error.
func open(t testing.TB, c *Client, url string) *Object {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	o, err := c.Open(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { o.Close() })
	return o
}

// within runs f, failing the test if it has not returned after d: a
// remote read must fail, never hang.
func within(t testing.TB, d time.Duration, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		f()
	}()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s still running after %v: hung", what, d)
	}
}

// nginxWith starts nginx over a new folder holding one random file of
// size bytes, name "disk.img", and returns the server and the file.
func nginxWith(t testing.TB, size int, tls bool) (*servers.Nginx, []byte) {
	t.Helper()
	root := t.TempDir()
	data := writeRandom(t, root, "disk.img", size, uint64(size))
	return servers.StartNginx(t, root, tls), data
}

// walkFiles calls f for every regular file under dir.
func walkFiles(t testing.TB, dir string, f func(path string, size int64)) {
	t.Helper()
	err := filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		f(path, info.Size())
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// damage flips a byte in the middle of a file.
func damage(t testing.TB, path string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)/2] ^= 0xff
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}
