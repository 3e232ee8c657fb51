package remote

import (
	"errors"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
	"github.com/qcowfs/qcowfs/test/servers"
)

// TestRemoteOffline: --offline serves a remote image from the disk cache
// while its server is down. top.qcow2 (over base.qcow2, on the server
// too) is hydrated whole by a mount with the server up, and part.qcow2
// only opened (its header and tables cached, not its data). Then nginx
// stops: an offline mount of top reads as qemu-img convert reads the
// local chain (cp --sparse=always), says offline in qcowfs status, and
// takes writes through an overlay; an offline mount of part fails the
// reads of its data with EIO, one log line saying so, and qcowfs status
// counting the failed reads with the reason; a URL never mounted, or a
// cache holding it in other chunks, fails the mount in one line naming
// the cache folder; --offline without --cache-dir, with a prefix or with
// --hydrate is a usage mistake. Before, nothing mounted without the server.
func TestRemoteOffline(t *testing.T) {
	root := harness.SourceDir(t)
	qemu.Make(t, filepath.Join(root, "base.qcow2"), "32M", "write -P 0x11 0 2M", "write -c -P 0x12 8M 256k")
	top := filepath.Join(root, "top.qcow2")
	qemu.Create(t, "qcow2", top, "32M", "-b", "base.qcow2", "-F", "qcow2")
	qemu.IO(t, top, "write -P 0x21 1M 2M", "write -z 8M 64k", "write -P 0x22 20M 1M")
	qemu.Make(t, filepath.Join(root, "part.qcow2"), "32M", "write -P 0x31 0 4M")
	work := t.TempDir()
	wantTop := wantRaw(t, work, top)
	ng := servers.StartNginx(t, root, false)
	cache := t.TempDir()

	m := mountRemote(t, harness.Daemon{}, ng.URL+"/top.qcow2", "--cache-dir", cache, "--hydrate")
	f := harness.Open(t, filepath.Join(m.Dir, "top.raw"))
	harness.WaitFor(t, "the hydrations to complete", 30*time.Second, func() bool {
		hs := remoteStats(t, m).Hydration
		done := 0
		for _, h := range hs {
			if h.State == "complete" {
				done++
			}
		}
		return len(hs) == 2 && done == 2
	})
	f.Close()
	m.Unmount(t)
	m = mountRemote(t, harness.Daemon{}, ng.URL+"/part.qcow2", "--cache-dir", cache)
	m.Unmount(t)
	ng.Stop()

	m = mountRemote(t, harness.Daemon{}, ng.URL+"/top.qcow2", "--cache-dir", cache, "--offline")
	got := filepath.Join(work, "copy.raw")
	harness.WantOK(t, "cp", harness.Exec(t, "cp", "--sparse=always", filepath.Join(m.Dir, "top.raw"), got))
	harness.SameFile(t, got, wantTop)
	st, _ := harness.StatusOf(t, m.Dir)
	if rs := st.Images.Remote; !st.Offline || rs == nil || rs.Requests != 0 || st.Images.ReadErrors != 0 {
		t.Errorf("qcowfs status of the offline mount: offline %v, remote %+v, read errors %d; want offline, no request, no error", st.Offline, rs, st.Images.ReadErrors)
	}
	if r := harness.Run(t, "status", m.Dir); !strings.Contains(r.Stdout, "offline: served from the disk cache "+cache) {
		t.Errorf("qcowfs status does not say the mount is offline:\n%s", r.Stdout)
	}
	m.Unmount(t)
	// Written through an overlay, over the pinned base.
	ov := t.TempDir()
	m = mountRemote(t, harness.Daemon{}, ng.URL+"/top.qcow2", "--cache-dir", cache, "--offline", "--writable", "--overlay", ov)
	writeThrough(t, filepath.Join(m.Dir, "top.raw"), overlayWrites[:3])
	m.Unmount(t)
	m = mountRemote(t, harness.Daemon{}, ng.URL+"/top.qcow2", "--cache-dir", cache, "--offline", "--writable", "--overlay", ov)
	want := localCopy(t, top, filepath.Join(work, "local.qcow2"), overlayWrites[:3])
	harness.SameFile(t, filepath.Join(m.Dir, "top.raw"), qemu.ToRaw(t, want, filepath.Join(work, "want.raw")))
	m.Unmount(t)

	// part: its header and tables were read, and its first sectors
	// (for a partition table); the rest of its data was not.
	m = mountRemote(t, harness.Daemon{}, ng.URL+"/part.qcow2", "--cache-dir", cache, "--offline")
	f = harness.Open(t, filepath.Join(m.Dir, "part.raw"))
	for _, off := range []int64{1 << 20, 3 << 20} {
		if _, err := f.ReadAt(make([]byte, 4096), off); !errors.Is(err, syscall.EIO) {
			t.Errorf("offline read at %d of data never fetched: %v, want EIO", off, err)
		}
	}
	if n := strings.Count(m.LogText(t), "offline, and a read needs chunks the disk cache does not hold"); n != 1 {
		t.Errorf("%d log lines say a read needs what the disk cache lacks, want 1:\n%s", n, m.LogText(t))
	}
	st, _ = harness.StatusOf(t, m.Dir)
	if e := st.Images.LastError; st.Images.ReadErrors == 0 || e == nil || !strings.Contains(e.Error, "not in the disk cache") {
		t.Errorf("qcowfs status of failed offline reads: %d read errors, last %+v; want them, saying not in the disk cache", st.Images.ReadErrors, e)
	}
	f.Close()
	m.Unmount(t)

	// What cannot be served offline.
	for _, c := range []struct {
		args  []string
		words []string
		code  int
	}{
		{[]string{"--remote-chunk-size=64K", "--cache-dir", cache, ng.URL + "/never.qcow2"}, []string{"never.qcow2", "offline", cache, "no version"}, 1},
		{[]string{"--remote-chunk-size=128K", "--cache-dir", cache, ng.URL + "/top.qcow2"}, []string{"--remote-chunk-size=65536", cache}, 1},
		{[]string{ng.URL + "/top.qcow2"}, []string{"--offline", "--cache-dir"}, 2},
		{[]string{"--cache-dir", cache, "s3://bucket/prefix/"}, []string{"--offline", "prefix"}, 2},
		{[]string{"--cache-dir", cache, "--hydrate", ng.URL + "/top.qcow2"}, []string{"--offline", "--hydrate"}, 2},
	} {
		mnt := t.TempDir()
		harness.Cleanup(t, mnt)
		args := append(append([]string{"mount", "--offline"}, c.args...), mnt)
		r := harness.Run(t, args...)
		harness.WantError(t, "qcowfs "+strings.Join(args, " "), r, c.words...)
		if r.Code != c.code {
			t.Errorf("qcowfs %s: exit status %d, want %d", strings.Join(args, " "), r.Code, c.code)
		}
		if harness.MountAt(t, mnt) != nil {
			t.Errorf("qcowfs %s mounted", strings.Join(args, " "))
		}
	}
}
