package remote

import (
	"bytes"
	"context"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/smithy-go/logging"
	"github.com/qcowfs/qcowfs/test/servers"
)

// TestOpenFailsFast: where no server can be reached (a closed port, a
// name that does not resolve) Open and List fail at once with the cause,
// not after Timeout of retries; so do a 4xx status and a server that does
// not speak TLS on an https:// URL.
func TestOpenFailsFast(t *testing.T) {
	ng, _ := nginxWith(t, 1<<20, false)
	closed := closedPort(t)
	opts := testOptions(nil)
	opts.Timeout = 20 * time.Second
	opts.S3Endpoint = "http://" + closed
	opts.S3Region = "us-east-1"
	opts.S3Credentials = staticCreds()
	c := newClient(t, opts)
	for _, tc := range []struct {
		url, says string
		list      bool
	}{
		{url: "http://" + closed + "/disk.img", says: "connection refused"},
		{url: "http://qcowfs-test.invalid/disk.img", says: "no such host"},
		{url: ng.URL + "/missing.img", says: "404"},
		{url: "https://" + strings.TrimPrefix(ng.URL, "http://") + "/disk.img", says: "TLS"},
		{url: "s3://bucket/key", says: "connection refused"},
		{url: "s3://bucket/prefix/", says: "connection refused", list: true},
	} {
		start := time.Now()
		var err error
		if tc.list {
			_, err = c.List(context.Background(), tc.url)
		} else {
			_, err = c.Open(context.Background(), tc.url)
		}
		d := time.Since(start)
		if err == nil || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%s: %v; want an error saying %q", tc.url, err, tc.says)
		}
		if d > time.Second {
			t.Errorf("%s: failed after %v; want at once", tc.url, d)
		}
	}
}

// closedPort returns 127.0.0.1:PORT where nothing listens.
func closedPort(t testing.TB) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// TestDownFailsAtOnce: once a read timed out (a server that stalls
// every request), the object's reads that need the server fail at once
// with ErrTimeout, including those already waiting for a chunk, while
// cached chunks still read; when the server answers again, the probe
// finds it and reads fetch again, without a new Open.
func TestDownFailsAtOnce(t *testing.T) {
	ng, data := nginxWith(t, 2<<20, false)
	px := servers.NewFaultProxy(t, ng.URL)
	var log logBuf
	opts := testOptions(&log)
	opts.Timeout = time.Second
	opts.StallTimeout = 300 * time.Millisecond
	o := open(t, newClient(t, opts), px.URL+"/disk.img")
	cs := opts.ChunkSize
	p := make([]byte, 1000)
	if _, err := o.ReadAt(p, 2*cs); err != nil {
		t.Fatal(err)
	}
	px.Set(servers.Fault{Kind: servers.Stall})
	start := time.Now()
	// Two readers: the second waits for a chunk the first started.
	errs := make(chan error, 2)
	for range 2 {
		go func() {
			_, err := o.ReadAt(make([]byte, 1000), 10*cs)
			errs <- err
		}()
	}
	for range 2 {
		if err := <-errs; !errors.Is(err, ErrTimeout) {
			t.Errorf("read through a stalled server: %v; want ErrTimeout", err)
		}
	}
	if d := time.Since(start); d > opts.Timeout+time.Second {
		t.Errorf("the stalled reads took %v; want at most the timeout %v and a second", d, opts.Timeout)
	}
	for i := range 5 {
		start := time.Now()
		_, err := o.ReadAt(p, int64(12+i)*cs)
		if d := time.Since(start); !errors.Is(err, ErrTimeout) || d > 100*time.Millisecond {
			t.Errorf("read %d after the timeout: %v after %v; want ErrTimeout at once", i, err, d)
		}
	}
	if _, err := o.ReadAt(p, 2*cs); err != nil || !bytes.Equal(p, data[2*cs:2*cs+1000]) {
		t.Errorf("a cached chunk while the server does not answer: %v", err)
	}
	px.Clear()
	px.Release()
	deadline := time.Now().Add(5 * time.Second)
	for {
		_, err := o.ReadAt(p, 20*cs)
		if err == nil {
			if !bytes.Equal(p, data[20*cs:20*cs+1000]) {
				t.Error("wrong bytes after the server came back")
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("still failing 5 s after the server answers again: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if log.count("does not answer") != 1 || log.count("answers again; reads fetch again") != 1 {
		t.Errorf("want one line for the server going away and one for its return:\n%s", log.String())
	}
}

// TestSDKLogToLog: the AWS SDK's own lines go to the Client's log (the
// daemon's), not to stderr.
func TestSDKLogToLog(t *testing.T) {
	var log logBuf
	opts := testOptions(&log)
	opts.S3Endpoint, opts.S3Region, opts.S3Credentials = "http://"+closedPort(t), "us-east-1", staticCreds()
	c := newClient(t, opts)
	api, err := c.s3Client(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	api.Options().Logger.Logf(logging.Warn, "a warning of the SDK's %d", 42)
	if !strings.Contains(log.String(), "a warning of the SDK's 42") {
		t.Errorf("the SDK's warning is not in the Client's log: %q", log.String())
	}
}

// TestNoInstanceMetadata: with an S3 endpoint and no credentials anywhere
// else, the credential chain fails at once without asking the instance
// metadata service (here a listener standing in for it, through the
// SDK's AWS_EC2_METADATA_SERVICE_ENDPOINT).
func TestNoInstanceMetadata(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	var asked atomic.Int32
	go func() {
		for {
			conn, err := l.Accept()
			if err != nil {
				return
			}
			asked.Add(1)
			conn.Close()
		}
	}()
	none := filepath.Join(t.TempDir(), "none")
	for k, v := range map[string]string{
		"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_SESSION_TOKEN": "", "AWS_PROFILE": "",
		"AWS_CONFIG_FILE": none, "AWS_SHARED_CREDENTIALS_FILE": none, "AWS_EC2_METADATA_DISABLED": "",
		"AWS_CONTAINER_CREDENTIALS_RELATIVE_URI": "", "AWS_CONTAINER_CREDENTIALS_FULL_URI": "",
		"AWS_WEB_IDENTITY_TOKEN_FILE": "", "AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://" + l.Addr().String(),
	} {
		t.Setenv(k, v)
	}
	opts := testOptions(nil)
	opts.S3Endpoint, opts.S3Region = "http://"+closedPort(t), "us-east-1"
	start := time.Now()
	_, err = newClient(t, opts).List(context.Background(), "s3://bucket/")
	if !errors.Is(err, ErrAuth) {
		t.Errorf("list without credentials: %v; want ErrAuth", err)
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("failing for want of credentials took %v", d)
	}
	if n := asked.Load(); n != 0 {
		t.Errorf("the instance metadata service was asked %d times", n)
	}
}

func staticCreds() credentials.StaticCredentialsProvider {
	return credentials.NewStaticCredentialsProvider(testAccess, testSecret, "")
}
