package remote

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
	"github.com/qcowfs/qcowfs/test/servers"
)

// TestRemoteHydrate: --hydrate with --cache-dir over an image on nginx
// with data, a compressed cluster, and clusters a discard freed (their
// bytes still in the file). Opening vm.raw, without reading it, starts
// the hydration; qcowfs status shows it running, then complete at 100 %
// of the bytes needed. nginx's log: every data cluster (qemu-img map)
// fetched exactly once, and no request touches the freed clusters. Then
// nginx is stopped and cp --sparse=always of vm.raw still gives qemu's
// bytes: the reads never needed the network. A second mount over the same
// cache folder, meanwhile, hydrates without fetching anything.
func TestRemoteHydrate(t *testing.T) {
	harness.RequireFUSE(t)
	root := qemu.TempDir(t)
	img := filepath.Join(root, "vm.qcow2")
	qemu.Create(t, "qcow2", img, "64M")
	qemu.IO(t, img, "write -P 0x11 0 2M", "write -P 0x22 10M 3M", "write -c -P 0x33 30M 64k", "write -P 0x44 50M 1M")
	var freed []int64 // host offsets of clusters the discard frees
	for _, e := range qemu.Map(t, img) {
		if e.Offset != nil && e.Start < 11<<20+512<<10 && e.Start+e.Length > 11<<20 {
			for p := max(e.Start, 11<<20); p < min(e.Start+e.Length, 11<<20+512<<10); p += 64 << 10 {
				freed = append(freed, *e.Offset+p-e.Start)
			}
		}
	}
	qemu.IO(t, img, "discard 11M 512k")
	if len(freed) != 8 {
		t.Fatalf("want 8 clusters freed by the discard, qemu-img map says %v", freed)
	}
	work := t.TempDir()
	want := qemu.ToRaw(t, img, filepath.Join(work, "want.raw"))
	const cs = 64 << 10      // the cluster size, and the tests' chunk size
	data := map[int64]bool{} // host chunks holding data clusters
	for _, e := range qemu.Map(t, img) {
		if e.Data && e.Offset != nil {
			for p := *e.Offset; p < *e.Offset+e.Length; p += cs {
				data[p/cs] = true
			}
		}
	}
	ng := servers.StartNginx(t, root, false)
	url := ng.URL + "/vm.qcow2"

	if _, out, err := tryMountRemote(t, harness.Daemon{}, url, "--hydrate"); err == nil || !strings.Contains(out, "--cache-dir") {
		t.Errorf("--hydrate without --cache-dir: %v, %q; want a refusal naming --cache-dir", err, out)
	}
	cache := t.TempDir()
	m := mountRemote(t, harness.Racy, url, "--cache-dir", cache, "--hydrate")
	f, err := os.Open(filepath.Join(m.Dir, "vm.raw"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var h harness.Hydration
	harness.WaitFor(t, "the hydration to complete", 30*time.Second, func() bool {
		hs := remoteStats(t, m).Hydration
		if len(hs) != 1 {
			return false
		}
		h = hs[0]
		return h.State != "running"
	})
	if h.State != "complete" || h.Percent != 100 || h.Done != h.Needed || h.URL != url {
		t.Fatalf("hydration status %+v; want %s complete", h, url)
	}
	// Needed: the metadata and data clusters, not the freed ones.
	if st, err := os.Stat(img); err != nil || h.Needed > st.Size()-int64(len(freed))*cs {
		t.Errorf("hydration needs %d bytes of a file of %d with %d freed clusters (%v)", h.Needed, st.Size(), len(freed), err)
	}
	r := harness.Run(t, "status", m.Dir)
	if !strings.Contains(r.Stdout, "hydration:   1 file") || !strings.Contains(r.Stdout, url+": complete, 100.0% of") {
		t.Errorf("qcowfs status does not show the hydration:\n%s", r.Stdout)
	}

	fetched := map[int64]int{}
	for _, a := range ng.Log(t) {
		var lo, hi int64
		if _, err := fmt.Sscanf(a.Range, "bytes=%d-%d", &lo, &hi); err != nil {
			continue
		}
		for _, fr := range freed {
			if lo <= fr+cs-1 && fr <= hi {
				t.Errorf("request for %s: touches the freed cluster at %d", a.Range, fr)
			}
		}
		for p := lo / cs * cs; p <= hi; p += cs {
			fetched[p/cs]++
		}
	}
	for idx := range data {
		if fetched[idx] != 1 {
			t.Errorf("data chunk %d fetched %d times, want once", idx, fetched[idx])
		}
	}

	// A second mount of the same version starts warm: its hydration
	// finds every chunk in the disk cache and fetches nothing.
	m2 := mountRemote(t, harness.Daemon{}, url, "--cache-dir", cache, "--hydrate")
	f2, err := os.Open(filepath.Join(m2.Dir, "vm.raw"))
	if err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, "the second hydration to end", 30*time.Second, func() bool {
		hs := remoteStats(t, m2).Hydration
		if len(hs) != 1 {
			return false
		}
		h = hs[0]
		return h.State != "running"
	})
	if h.State != "complete" || h.Fetched != 0 {
		t.Errorf("hydration of a second mount over the same cache: %+v; want complete, nothing fetched", h)
	}
	f2.Close()
	m2.Unmount(t)

	ng.Stop()
	out := filepath.Join(work, "copy.raw")
	if b, err := exec.Command("cp", "--sparse=always", filepath.Join(m.Dir, "vm.raw"), out).CombinedOutput(); err != nil {
		t.Fatalf("cp of the hydrated image with nginx stopped: %v %s", err, b)
	}
	harness.SameFile(t, out, want)
}

// TestRemoteHydrateS3: --hydrate=RATE over a versitygw prefix: the image
// opened is hydrated to complete (the other, never opened, is not), and
// then cp --sparse=always of it sends no request (the daemon's counters)
// and gives qemu's bytes.
func TestRemoteHydrateS3(t *testing.T) {
	srv := startS3(t, "hyd")
	work := qemu.TempDir(t)
	img := filepath.Join(work, "vm.qcow2")
	qemu.Create(t, "qcow2", img, "32M")
	qemu.IO(t, img, "write -P 0x51 1M 3M", "write -c -P 0x52 20M 256k")
	other := filepath.Join(work, "other.qcow2")
	qemu.Create(t, "qcow2", other, "8M")
	qemu.IO(t, other, "write -P 0x53 0 1M")
	putFile(t, srv, "hyd", "p/vm.qcow2", img)
	putFile(t, srv, "hyd", "p/other.qcow2", other)
	m := mountRemote(t, harness.Daemon{Env: s3Env(t, srv.Access, srv.Secret)}, "s3://hyd/p/", "--s3-endpoint", srv.Endpoint,
		"--cache-dir", t.TempDir(), "--hydrate=64M")
	f, err := os.Open(filepath.Join(m.Dir, "vm.raw"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var hs []harness.Hydration
	harness.WaitFor(t, "the hydration to complete", 30*time.Second, func() bool {
		hs = remoteStats(t, m).Hydration
		return len(hs) == 1 && hs[0].State != "running"
	})
	if hs[0].State != "complete" || hs[0].URL != "s3://hyd/p/vm.qcow2" {
		t.Fatalf("hydrations %+v; want s3://hyd/p/vm.qcow2 complete, nothing else", hs)
	}
	before := remoteStats(t, m).Requests
	out := filepath.Join(work, "copy.raw")
	if b, err := exec.Command("cp", "--sparse=always", filepath.Join(m.Dir, "vm.raw"), out).CombinedOutput(); err != nil {
		t.Fatalf("cp: %v %s", err, b)
	}
	harness.SameFile(t, out, wantRaw(t, t.TempDir(), img))
	if after := remoteStats(t, m).Requests; after != before {
		t.Errorf("cp of the hydrated image sent %d requests", after-before)
	}
}

// syncBuf is a bytes.Buffer safe for a writer and a reader at once.
type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestRemoteHydrateProgress: qcowfs mount --foreground --hydrate=2M on a
// terminal (script(1) gives it one) shows the hydration's progress in a
// line on stderr while it runs (12 MiB at 2 MiB/s, in runs of 4 MiB: four
// seconds), and the total once complete.
func TestRemoteHydrateProgress(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "script")
	root := qemu.TempDir(t)
	img := filepath.Join(root, "vm.qcow2")
	qemu.Create(t, "qcow2", img, "16M")
	qemu.IO(t, img, "write -P 0x61 0 12M")
	ng := servers.StartNginx(t, root, false)
	mnt := t.TempDir()
	harness.Cleanup(t, mnt)
	logFile := filepath.Join(t.TempDir(), "log")
	defer func() {
		if t.Failed() {
			b, _ := os.ReadFile(logFile)
			t.Logf("log:\n%s", b)
		}
	}()
	line := strings.Join([]string{harness.Bin(), "mount", "-f", "--log-file", logFile,
		"--cache-dir", t.TempDir(), "--hydrate=2M", ng.URL + "/vm.qcow2", mnt}, " ")
	cmd := exec.Command("script", "-qfec", line, "/dev/null")
	var out syncBuf
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	harness.WaitFor(t, "the foreground mount", 10*time.Second, func() bool { return harness.IsMounted(mnt) })
	f, err := os.Open(filepath.Join(mnt, "vm.raw"))
	if err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, "the progress line to say it is complete", 20*time.Second, func() bool {
		return strings.Contains(out.String(), "hydrated 1 file: 100.0% of")
	})
	f.Close()
	for _, pid := range harness.Daemons(t, mnt) {
		syscall.Kill(pid, syscall.SIGTERM)
	}
	harness.WaitGone(t, mnt)
	if !strings.Contains(out.String(), "hydrating 1 file: ") || !strings.Contains(out.String(), "MiB/s") {
		t.Errorf("no progress line while the hydration ran:\n%q", out.String())
	}
}
