package remote

import (
	"bytes"
	"context"
	"errors"
	"testing"
)

// TestOffline: an offline Client over the disk cache an online one
// filled sends no request: it opens the URL at the version the online
// Open recorded (the same size and ETag), reads the chunks the online
// reads stored, and fails the others with ErrOffline, logged once. A URL
// never opened online, another chunk size, a listing and a hydration are
// refused with ErrOffline; Offline without CacheDir is no Client.
func TestOffline(t *testing.T) {
	const size = 2 << 20
	ng, data := nginxWith(t, size, false)
	url := ng.URL + "/disk.img"
	opts := testOptions(nil)
	opts.CacheDir = t.TempDir()
	c := newClient(t, opts)
	o := open(t, c, url)
	p := make([]byte, 512<<10)
	if _, err := o.ReadAt(p, 0); err != nil {
		t.Fatal(err)
	}
	o.Close()
	ng.Stop()

	var log logBuf
	off := testOptions(&log)
	off.CacheDir, off.Offline = opts.CacheDir, true
	c2 := newClient(t, off)
	o2 := open(t, c2, url)
	if o2.Size() != o.Size() || o2.ETag() != o.ETag() || o2.Version() != o.Version() {
		t.Errorf("offline: size %d, ETag %s, version %s; online %d, %s, %s", o2.Size(), o2.ETag(), o2.Version(), o.Size(), o.ETag(), o.Version())
	}
	got := make([]byte, len(p))
	if _, err := o2.ReadAt(got, 0); err != nil || !bytes.Equal(got, data[:len(p)]) {
		t.Errorf("offline read of what the online read stored: %v (equal %v)", err, bytes.Equal(got, data[:len(p)]))
	}
	for range 3 {
		if _, err := o2.ReadAt(make([]byte, 4096), 1<<20); !errors.Is(err, ErrOffline) {
			t.Errorf("offline read of what no read stored: %v, want ErrOffline", err)
		}
	}
	if n := log.count("offline, and a read needs chunks"); n != 1 {
		t.Errorf("%d log lines for reads refused offline, want 1:\n%s", n, log.String())
	}
	if st := c2.Stats(); st.Requests != 0 || !st.Offline {
		t.Errorf("offline Client stats %+v; want no request, offline", st)
	}

	for _, c := range []struct {
		what string
		err  func() error
	}{
		{"a URL never opened", func() error { _, err := c2.Open(context.Background(), ng.URL+"/other.img"); return err }},
		{"a listing", func() error { _, err := c2.List(context.Background(), "s3://bucket/prefix/"); return err }},
		{"a hydration", func() error { _, err := o2.Hydrate([]Span{{0, size}}); return err }},
		{"another chunk size", func() error {
			o := off
			o.ChunkSize *= 2
			_, err := newClient(t, o).Open(context.Background(), url)
			return err
		}},
	} {
		if err := c.err(); !errors.Is(err, ErrOffline) {
			t.Errorf("offline, %s: %v, want ErrOffline", c.what, err)
		}
	}
	o3 := off
	o3.CacheDir = ""
	if _, err := NewClient(context.Background(), o3); err == nil {
		t.Errorf("an offline Client without a disk cache was made")
	}
}
