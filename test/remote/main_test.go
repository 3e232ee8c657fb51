// Package remote tests images over HTTP(S) and S3 (nginx, versitygw, a
// fault proxy) through a mount and through info, map and check, and
// writable mounts of them through local overlays (overlay_test.go);
// encrypted images read, and written through encrypted overlays
// (encrypted_test.go).
package remote

// TestMain, and the helpers of the remote image tests: mounting a URL
// with the daemon's environment (S3 keys) set, the daemon's remote
// counters, a bucket.

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
	"github.com/qcowfs/qcowfs/test/servers"
)

func TestMain(m *testing.M) { harness.Main(m) }

// remoteFlags are what every remote mount of the tests gets: small
// chunks (fetches close to what is read), quick failure, a short refresh.
var remoteFlags = []string{"--remote-chunk-size=64K", "--remote-timeout=10s", "--remote-refresh=1s"}

// mountRemote mounts the URL src by the daemon d (S3 keys in its
// environment, racy or not) with remoteFlags and args, read-ahead off, and
// unmounts it when the test ends. A failed mount fails the test.
func mountRemote(t testing.TB, d harness.Daemon, src string, args ...string) *harness.Mounted {
	t.Helper()
	m, out, err := tryMountRemote(t, d, src, args...)
	if err != nil {
		t.Fatalf("qcowfs mount %s: %v\n%s", src, err, out)
	}
	return m
}

// tryMountRemote is mountRemote returning the failure (and the output).
func tryMountRemote(t testing.TB, d harness.Daemon, src string, args ...string) (*harness.Mounted, string, error) {
	t.Helper()
	all := append(append([]string{"--read-ahead=0"}, remoteFlags...), args...)
	return d.TryMount(t, src, all...)
}

// remoteStats are the remote client's counters of the mount m, from
// qcowfs status.
func remoteStats(t testing.TB, m *harness.Mounted) harness.RemoteStats {
	t.Helper()
	st, out := harness.StatusOf(t, m.Dir)
	if st.Images.Remote == nil {
		t.Fatalf("qcowfs status has no remote counters:\n%s", out)
	}
	return *st.Images.Remote
}

// s3Env is the environment of a daemon reading srv with these keys: the
// AWS SDK's standard variables, and nothing from the host's AWS
// configuration.
func s3Env(t testing.TB, access, secret string) []string {
	cfg := filepath.Join(t.TempDir(), "none")
	return []string{
		"AWS_ACCESS_KEY_ID=" + access, "AWS_SECRET_ACCESS_KEY=" + secret, "AWS_REGION=us-east-1",
		"AWS_CONFIG_FILE=" + cfg, "AWS_SHARED_CREDENTIALS_FILE=" + cfg, "AWS_EC2_METADATA_DISABLED=true",
	}
}

// startS3 starts versitygw over a fresh folder with one bucket.
func startS3(t testing.TB, bucket string) *servers.S3Server {
	t.Helper()
	harness.RequireFUSE(t)
	srv := servers.StartVersity(t, t.TempDir(), "qcowfs-test-access", "qcowfs-test-secret-0123456789")
	srv.MakeBucket(t, bucket, false)
	return srv
}

// putFile stores the file at path as bucket/key.
func putFile(t testing.TB, srv *servers.S3Server, bucket, key, path string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	srv.Put(t, bucket, key, b)
}

// wantRaw converts image with qemu-img into a raw file in dir and returns
// its path: what every read through a mount must equal.
func wantRaw(t testing.TB, dir, image string) string {
	t.Helper()
	return qemu.ToRaw(t, image, filepath.Join(dir, strings.TrimSuffix(filepath.Base(image), ".qcow2")+".raw"))
}

// execOut runs a command and returns its output (stdout and stderr).
func execOut(name string, args ...string) (string, error) {
	out, err := exec.Command(name, args...).CombinedOutput()
	return string(out), err
}

// curlTimeout bounds one run of qemu-img that reads over http: the runs
// here (check, compare, convert of overlays over images of at most a few
// tens of MiB from nginx on localhost) take 5 to 35 ms; 10 s is hundreds
// of times that, and is what a hang costs before the run is made again.
const curlTimeout = 10 * time.Second

// curlQemu runs qemu-img with args where qemu reads a backing file over
// http (its curl driver), and returns its output. qemu 7.2's curl driver
// now and then stops making progress with every byte it asked for
// received (docs/benchmarks.md: convert hangs on the 2 GiB image; seen
// here on an 80 MiB one, under load): a run that outlives curlTimeout is
// killed, logged and made again, at most three times; a hang is never
// taken for a result.
func curlQemu(t testing.TB, args ...string) (string, error) {
	t.Helper()
	for range 3 {
		ctx, cancel := context.WithTimeout(context.Background(), curlTimeout)
		out, err := exec.CommandContext(ctx, "qemu-img", args...).CombinedOutput()
		hung := ctx.Err() != nil
		cancel()
		if !hung {
			return string(out), err
		}
		t.Logf("qemu-img %s: no answer in %v (qemu's curl driver hung); again", strings.Join(args, " "), curlTimeout)
	}
	return "", fmt.Errorf("qemu-img %s hung three times", strings.Join(args, " "))
}

// checkCleanCurl is qemu.CheckClean of an overlay whose backing file
// qemu reads over http.
func checkCleanCurl(t testing.TB, image string) {
	t.Helper()
	out, err := curlQemu(t, "check", image)
	if err != nil || !strings.Contains(out, "No errors were found") {
		t.Fatalf("qemu-img check %s: %v\n%s", image, err, out)
	}
}
