package test

// Helpers of the remote image tests (remote_*_test.go): mounting a URL
// with the daemon's environment (S3 keys) set, the daemon's remote
// counters, the data runs of a file.

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qcowfs/qcowfs/test/qemu"
	"github.com/qcowfs/qcowfs/test/servers"
)

// remoteFlags are what every remote mount of the tests gets: small
// chunks (fetches close to what is read), quick failure, a short refresh.
var remoteFlags = []string{"--remote-chunk-size=64K", "--remote-timeout=10s", "--remote-refresh=1s"}

// mountRemote mounts the URL src with `qcowfs mount` as a daemon, with env
// added to its environment, and unmounts it when the test ends. It fails
// the test if the mount fails.
func mountRemote(t testing.TB, src string, env []string, args ...string) *mount {
	t.Helper()
	m, out, err := tryMountRemote(t, src, env, args...)
	if err != nil {
		t.Fatalf("qcowfs mount %s: %v\n%s", src, err, out)
	}
	return m
}

// tryMountRemote is mountRemote returning the failure (and the output).
func tryMountRemote(t testing.TB, src string, env []string, args ...string) (*mount, string, error) {
	t.Helper()
	requireFUSE(t)
	m := &mount{Dir: t.TempDir(), Log: filepath.Join(t.TempDir(), "qcowfs.log")}
	all := append([]string{"mount", "--log-file", m.Log, "--log-level", "debug", "--read-ahead=0"}, remoteFlags...)
	racy := false
	for _, a := range args {
		if a == racyMount {
			racy = true
			continue
		}
		all = append(all, a)
	}
	all = append(all, src, m.Dir)
	// With racyMount, the race-detecting build when there is one.
	cmd := exec.Command(qcowfsBin, all...)
	cmd.Env = append(os.Environ(), env...)
	if racy && raceBin != "" {
		cmd = exec.Command(raceBin, all...)
		cmd.Env = append(os.Environ(), append(env, "GORACE=log_path="+filepath.Join(raceDir, "report")+" halt_on_error=0")...)
	}
	r := cliRunCmd(t, cmd)
	out := r.stdout + r.stderr
	if r.code != 0 {
		if isMounted(m.Dir) {
			t.Errorf("qcowfs mount failed (%d) but left %s mounted", r.code, m.Dir)
			m.unmount(t)
		}
		return nil, out, &exec.ExitError{}
	}
	t.Cleanup(func() { m.unmount(t) })
	return m, out, nil
}

// remoteStats is the part of `qcowfs status --output=json` the tests read:
// the remote client's counters.
type remoteStats struct {
	Requests int64 `json:"requests"`
	Bytes    int64 `json:"bytes"`
	Retries  int64 `json:"retries"`
	Errors   int64 `json:"errors"`
}

func (m *mount) remoteStats(t testing.TB) remoteStats {
	t.Helper()
	out, err := qcowfs("status", "--output=json", m.Dir)
	if err != nil {
		t.Fatalf("qcowfs status: %v\n%s", err, out)
	}
	var s struct {
		Images struct {
			Remote *remoteStats `json:"remote"`
		} `json:"images"`
	}
	if err := json.Unmarshal([]byte(out), &s); err != nil {
		t.Fatalf("qcowfs status: %v\n%s", err, out)
	}
	cliKebabKeys(t, out)
	if s.Images.Remote == nil {
		t.Fatalf("qcowfs status has no remote counters:\n%s", out)
	}
	return *s.Images.Remote
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
	requireFUSE(t)
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
