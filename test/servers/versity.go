package servers

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"
)

// S3Server is a versitygw started by StartVersity.
type S3Server struct {
	Endpoint string // http://127.0.0.1:PORT
	Access   string // the root user's access key
	Secret   string // and secret key
	Region   string
	Root     string // the folder served: one subfolder per bucket
	proc     *process
}

// VersityOptions are the less common settings of StartVersityWith.
type VersityOptions struct {
	// Versioning enables bucket versioning (versitygw keeps old versions
	// in a folder of the test's). Buckets still need it turned on with
	// PutBucketVersioning; MakeBucket(t, name, true) does.
	Versioning bool
}

// StartVersity starts versitygw with its posix backend over root (buckets
// are root's subfolders), with a root user of the given keys, on
// 127.0.0.1; it is stopped when the test ends.
func StartVersity(t testing.TB, root, access, secret string) *S3Server {
	t.Helper()
	return StartVersityWith(t, root, access, secret, VersityOptions{})
}

// StartVersityWith is StartVersity with options.
func StartVersityWith(t testing.TB, root, access, secret string, o VersityOptions) *S3Server {
	t.Helper()
	bin := Require(t, "versitygw")
	var err error
	if root, err = filepath.Abs(root); err != nil {
		t.Fatal(err)
	}
	logDir := t.TempDir()
	var lastErr error
	for range 5 {
		port := freePort(t)
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		args := []string{"--port", addr, "--quiet", "--health", "/health", "posix"}
		if o.Versioning {
			dir := filepath.Join(logDir, "versions")
			if err := os.MkdirAll(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			args = append(args, "--versioning-dir", dir)
		}
		args = append(args, root)
		cmd := exec.Command(bin, args...)
		cmd.Env = append(os.Environ(), "ROOT_ACCESS_KEY="+access, "ROOT_SECRET_KEY="+secret)
		p := start(t, "versitygw", cmd, filepath.Join(logDir, "versitygw.log"))
		health := "http://" + addr + "/health"
		lastErr = p.waitUp(func(ctx context.Context) error {
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, health, nil)
			resp, err := http.DefaultTransport.RoundTrip(req)
			if err != nil {
				return err
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("%s: status %d", health, resp.StatusCode)
			}
			return nil
		})
		if lastErr != nil {
			p.stop()
			if bytes.Contains([]byte(p.output()), []byte("address already in use")) {
				continue
			}
			break
		}
		t.Cleanup(p.stop)
		return &S3Server{Endpoint: "http://" + addr, Access: access, Secret: secret, Region: "us-east-1", Root: root, proc: p}
	}
	t.Fatalf("versitygw: %v", lastErr)
	return nil
}

// Client returns an S3 client for setting up the server's buckets and
// objects, signed with the root user's keys.
func (s *S3Server) Client() *s3.Client {
	return s3.New(s3.Options{
		Region:       s.Region,
		BaseEndpoint: aws.String(s.Endpoint),
		UsePathStyle: true,
		Credentials:  credentials.NewStaticCredentialsProvider(s.Access, s.Secret, ""),
	})
}

func setupCtx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), 30*time.Second)
}

// MakeBucket creates a bucket, versioned if versioned (the server must
// have been started with Versioning).
func (s *S3Server) MakeBucket(t testing.TB, name string, versioned bool) {
	t.Helper()
	ctx, cancel := setupCtx()
	defer cancel()
	if _, err := s.Client().CreateBucket(ctx, &s3.CreateBucketInput{Bucket: &name}); err != nil {
		t.Fatalf("create bucket %s: %v", name, err)
	}
	if versioned {
		_, err := s.Client().PutBucketVersioning(ctx, &s3.PutBucketVersioningInput{
			Bucket:                  &name,
			VersioningConfiguration: &types.VersioningConfiguration{Status: types.BucketVersioningStatusEnabled},
		})
		if err != nil {
			t.Fatalf("enable versioning on %s: %v", name, err)
		}
	}
}

// Put stores data as bucket/key and returns the object's ETag and version
// id ("" in an unversioned bucket).
func (s *S3Server) Put(t testing.TB, bucket, key string, data []byte) (etag, version string) {
	t.Helper()
	ctx, cancel := setupCtx()
	defer cancel()
	out, err := s.Client().PutObject(ctx, &s3.PutObjectInput{Bucket: &bucket, Key: &key, Body: bytes.NewReader(data)})
	if err != nil {
		t.Fatalf("put %s/%s: %v", bucket, key, err)
	}
	return aws.ToString(out.ETag), aws.ToString(out.VersionId)
}

// Presign returns a presigned https:// (here http://) URL of bucket/key,
// valid for an hour: what qemu's curl driver can open, as it cannot sign
// S3 requests.
func (s *S3Server) Presign(t testing.TB, bucket, key string) string {
	t.Helper()
	ctx, cancel := setupCtx()
	defer cancel()
	req, err := s3.NewPresignClient(s.Client()).PresignGetObject(ctx, &s3.GetObjectInput{Bucket: &bucket, Key: &key},
		s3.WithPresignExpires(time.Hour))
	if err != nil {
		t.Fatalf("presign %s/%s: %v", bucket, key, err)
	}
	return req.URL
}
