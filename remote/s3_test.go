package remote

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/qcowfs/qcowfs/test/servers"
)

const (
	testAccess = "qcowfs-test-access"
	testSecret = "qcowfs-test-secret-Xq83"
)

// s3Options are testOptions for the server s, with its keys.
func s3Options(s *servers.S3Server, secret string, log *logBuf) Options {
	o := testOptions(log)
	o.S3Endpoint = s.Endpoint
	o.S3Region = s.Region
	o.S3Credentials = credentials.NewStaticCredentialsProvider(s.Access, secret, "")
	return o
}

// TestS3Reads puts an object and compares ranged reads with it.
func TestS3Reads(t *testing.T) {
	s := servers.StartVersity(t, t.TempDir(), testAccess, testSecret)
	s.MakeBucket(t, "images", false)
	data := writeRandom(t, t.TempDir(), "x", 2<<20+777, 5)
	etag, _ := s.Put(t, "images", "vm/disk.qcow2", data)
	c := newClient(t, s3Options(s, s.Secret, nil))
	o := open(t, c, "s3://images/vm/disk.qcow2")
	if o.Size() != int64(len(data)) || o.Version() != etag {
		t.Fatalf("Size %d, Version %s; want %d, %s", o.Size(), o.Version(), len(data), etag)
	}
	r := rand.New(rand.NewPCG(3, 4))
	within(t, 30*time.Second, "S3 reads", func() {
		for range 100 {
			off := r.Int64N(int64(len(data)))
			n := min(1+r.IntN(200<<10), len(data)-int(off))
			p := make([]byte, n)
			if _, err := o.ReadAt(p, off); err != nil {
				t.Fatalf("ReadAt(%d, %d): %v", n, off, err)
			}
			if !bytes.Equal(p, data[off:off+int64(n)]) {
				t.Fatalf("ReadAt(%d, %d): bytes differ", n, off)
			}
		}
	})
}

// TestS3List lists nested prefixes over several pages, and sees objects
// added while another is open.
func TestS3List(t *testing.T) {
	s := servers.StartVersity(t, t.TempDir(), testAccess, testSecret)
	s.MakeBucket(t, "bkt", false)
	want := map[string]Entry{} // by key: what Put stored
	put := func(key string, size int) {
		data := writeRandom(t, t.TempDir(), "x", size, uint64(len(want)))
		etag, _ := s.Put(t, "bkt", key, data)
		if strings.HasPrefix(key, "imgs/") {
			want[key] = Entry{Key: key, Size: int64(size), ETag: etag}
		}
	}
	for _, k := range []string{"imgs/a.qcow2", "imgs/sub/b.qcow2", "imgs/sub/deep/c.qcow2", "imgs2/x", "other/y", "img"} {
		put(k, 1000+len(k))
	}
	for i := range 14 {
		put(fmt.Sprintf("imgs/many/%02d.qcow2", i), 100+i)
	}
	opts := s3Options(s, s.Secret, nil)
	opts.ListPageSize = 5
	c := newClient(t, opts)
	check := func() {
		t.Helper()
		before := c.Stats().Requests
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		got, err := c.List(ctx, "s3://bkt/imgs/")
		if err != nil {
			t.Fatal(err)
		}
		keys := slices.Sorted(maps.Keys(want))
		if len(got) != len(keys) {
			t.Fatalf("listed %d objects, want %d", len(got), len(keys))
		}
		for i, e := range got {
			w := want[keys[i]]
			if e.Key != w.Key || e.Size != w.Size || e.ETag != w.ETag || e.Name != strings.TrimPrefix(w.Key, "imgs/") ||
				e.URL != "s3://bkt/"+w.Key || e.ModTime.IsZero() {
				t.Errorf("entry %d: %+v, want %+v", i, e, w)
			}
		}
		if pages := (int64(len(keys)) + 4) / 5; c.Stats().Requests-before < pages {
			t.Errorf("%d requests to list %d objects 5 a page", c.Stats().Requests-before, len(keys))
		}
	}
	check()
	o := open(t, c, "s3://bkt/imgs/a.qcow2")
	put("imgs/new/added.qcow2", 4321)
	check()
	if _, err := o.ReadAt(make([]byte, 10), 0); err != nil {
		t.Errorf("the open object after an unrelated put: %v", err)
	}
	if _, err := c.List(context.Background(), "s3://nosuchbucket/"); !errors.Is(err, ErrNotFound) {
		t.Errorf("listing a missing bucket: %v; want ErrNotFound", err)
	}
	if _, err := c.List(context.Background(), "https://h/x/"); !errors.Is(err, ErrBadURL) {
		t.Errorf("listing an https URL: %v; want ErrBadURL", err)
	}
}

// TestS3WrongSecret: a wrong secret key fails Open and List at once with
// ErrAuth, and the secret shows nowhere.
func TestS3WrongSecret(t *testing.T) {
	s := servers.StartVersity(t, t.TempDir(), testAccess, testSecret)
	s.MakeBucket(t, "bkt", false)
	s.Put(t, "bkt", "k", []byte("data"))
	const wrong = "wrong-secret-Zz9"
	var log logBuf
	c := newClient(t, s3Options(s, wrong, &log))
	start := time.Now()
	_, err := c.Open(context.Background(), "s3://bkt/k")
	if !errors.Is(err, ErrAuth) {
		t.Fatalf("open with a wrong secret: %v; want ErrAuth", err)
	}
	_, lerr := c.List(context.Background(), "s3://bkt/")
	if !errors.Is(lerr, ErrAuth) {
		t.Fatalf("list with a wrong secret: %v; want ErrAuth", lerr)
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("auth failures took %v: they must not be retried", d)
	}
	for _, s := range []string{err.Error(), lerr.Error(), log.String()} {
		if strings.Contains(s, wrong) || strings.Contains(s, testSecret) {
			t.Errorf("a secret shows: %s", s)
		}
	}
	if !strings.Contains(err.Error(), "s3://bkt/k") || !strings.Contains(err.Error(), "403") {
		t.Errorf("error %q does not name the URL and the status", err)
	}
}

// TestS3CredentialChain finds the keys through the SDK's standard chain:
// the environment, then a shared credentials file and profile.
func TestS3CredentialChain(t *testing.T) {
	s := servers.StartVersity(t, t.TempDir(), testAccess, testSecret)
	s.MakeBucket(t, "bkt", false)
	s.Put(t, "bkt", "k", []byte("chain"))
	opts := s3Options(s, s.Secret, nil)
	opts.S3Credentials = nil
	t.Setenv("AWS_EC2_METADATA_DISABLED", "true") // never try an instance metadata service
	t.Setenv("AWS_CONFIG_FILE", filepath.Join(t.TempDir(), "none"))
	t.Setenv("AWS_PROFILE", "")

	t.Run("environment", func(t *testing.T) {
		t.Setenv("AWS_SHARED_CREDENTIALS_FILE", filepath.Join(t.TempDir(), "none"))
		t.Setenv("AWS_ACCESS_KEY_ID", s.Access)
		t.Setenv("AWS_SECRET_ACCESS_KEY", s.Secret)
		open(t, newClient(t, opts), "s3://bkt/k")
	})
	t.Run("profile", func(t *testing.T) {
		t.Setenv("AWS_ACCESS_KEY_ID", "")
		t.Setenv("AWS_SECRET_ACCESS_KEY", "")
		creds := filepath.Join(t.TempDir(), "credentials")
		body := fmt.Sprintf("[default]\naws_access_key_id = nobody\naws_secret_access_key = nothing\n\n[qtest]\naws_access_key_id = %s\naws_secret_access_key = %s\n", s.Access, s.Secret)
		if err := os.WriteFile(creds, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		t.Setenv("AWS_SHARED_CREDENTIALS_FILE", creds)
		t.Setenv("AWS_PROFILE", "qtest")
		open(t, newClient(t, opts), "s3://bkt/k")
		t.Setenv("AWS_PROFILE", "default")
		if _, err := newClient(t, opts).Open(context.Background(), "s3://bkt/k"); !errors.Is(err, ErrAuth) {
			t.Errorf("open with the default profile's unknown key: %v; want ErrAuth", err)
		}
	})
}

// TestS3Changed: an object overwritten while open fails reads with
// ErrChanged (If-Match on every GetObject).
func TestS3Changed(t *testing.T) {
	s := servers.StartVersity(t, t.TempDir(), testAccess, testSecret)
	s.MakeBucket(t, "bkt", false)
	data := writeRandom(t, t.TempDir(), "x", 1<<20, 1)
	s.Put(t, "bkt", "k", data)
	var log logBuf
	opts := s3Options(s, s.Secret, &log)
	o := open(t, newClient(t, opts), "s3://bkt/k")
	p := make([]byte, 1000)
	if _, err := o.ReadAt(p, 100000); err != nil || !bytes.Equal(p, data[100000:101000]) {
		t.Fatalf("read: %v", err)
	}
	s.Put(t, "bkt", "k", writeRandom(t, t.TempDir(), "x", 1<<20, 2))
	if n, err := o.ReadAt(p, 700000); !errors.Is(err, ErrChanged) || n != 0 {
		t.Fatalf("read after the overwrite: %d, %v; want ErrChanged", n, err)
	}
	if n, err := o.ReadAt(p, 100000); !errors.Is(err, ErrChanged) || n != 0 {
		t.Fatalf("cached read after the overwrite: %d, %v; want ErrChanged", n, err)
	}
	if n := log.count("changed while open"); n != 1 {
		t.Errorf("%d log lines about the change, want 1", n)
	}
	if _, err := newClient(t, opts).Open(context.Background(), "s3://bkt/missing"); !errors.Is(err, ErrNotFound) {
		t.Errorf("open of a missing key: %v; want ErrNotFound", err)
	}
}

// TestS3Faults: S3 through the fault proxy (signatures stay valid):
// throttling and dropped bodies are retried, stalls time out.
func TestS3Faults(t *testing.T) {
	s := servers.StartVersity(t, t.TempDir(), testAccess, testSecret)
	s.MakeBucket(t, "bkt", false)
	data := writeRandom(t, t.TempDir(), "x", 1<<20, 3)
	s.Put(t, "bkt", "k", data)
	px := servers.NewFaultProxy(t, s.Endpoint)
	const slowDown = `<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>`
	for _, c := range []struct {
		name    string
		fault   servers.Fault
		wantErr error
		says    string
	}{
		{"SlowDown twice", servers.Fault{Kind: servers.Status, Status: 503, Body: slowDown, Count: 2}, nil, ""},
		{"SlowDown always", servers.Fault{Kind: servers.Status, Status: 503, Body: slowDown}, ErrTimeout, "SlowDown"},
		{"dropped mid-body", servers.Fault{Kind: servers.Drop, After: 20000, Count: 2}, nil, ""},
		{"short body", servers.Fault{Kind: servers.ShortBody, After: 20000, Count: 1}, nil, ""},
		{"stall always", servers.Fault{Kind: servers.Stall}, ErrTimeout, "no byte received"},
	} {
		t.Run(strings.ReplaceAll(c.name, " ", "_"), func(t *testing.T) {
			opts := s3Options(s, s.Secret, nil)
			opts.S3Endpoint = px.URL
			opts.Timeout, opts.StallTimeout = time.Second, 300*time.Millisecond
			o := open(t, newClient(t, opts), "s3://bkt/k")
			px.Set(c.fault)
			defer func() { px.Clear(); px.Release() }()
			off, n := int64(300000), 200000
			p := make([]byte, n)
			var err error
			within(t, opts.Timeout+2*time.Second, "the read", func() { _, err = o.ReadAt(p, off) })
			if c.wantErr == nil {
				if err != nil || !bytes.Equal(p, data[off:off+int64(n)]) {
					t.Fatalf("read: %v", err)
				}
				if o.Stats().Retries == 0 {
					t.Errorf("no retry counted")
				}
				return
			}
			if !errors.Is(err, c.wantErr) || !strings.Contains(err.Error(), c.says) {
				t.Fatalf("read: %v; want %v saying %q", err, c.wantErr, c.says)
			}
		})
	}
}

// TestS3Versioned: in a versioned bucket reads are pinned to the version
// id first seen, so an overwrite goes unnoticed and every byte read is
// the old version's.
func TestS3Versioned(t *testing.T) {
	s := servers.StartVersityWith(t, t.TempDir(), testAccess, testSecret, servers.VersityOptions{Versioning: true})
	s.MakeBucket(t, "bkt", true)
	data := writeRandom(t, t.TempDir(), "x", 1<<20, 7)
	_, v1 := s.Put(t, "bkt", "k", data)
	if v1 == "" {
		t.Fatal("the versioned bucket gave no version id")
	}
	o := open(t, newClient(t, s3Options(s, s.Secret, nil)), "s3://bkt/k")
	if o.Version() != v1 {
		t.Errorf("Version %q, want the version id %q", o.Version(), v1)
	}
	s.Put(t, "bkt", "k", writeRandom(t, t.TempDir(), "x", 1<<20, 8))
	got := readAll(t, o, 100<<10)
	if !bytes.Equal(got, data) {
		t.Fatal("reads after an overwrite differ from the version opened")
	}
}
