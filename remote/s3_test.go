package remote

import (
	"bytes"
	"context"
	"math/rand/v2"
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
	_ = context.Background
}
