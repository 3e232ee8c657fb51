package remote

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
	"github.com/qcowfs/qcowfs/test/servers"
)

// TestRemoteFaults puts a fault-injecting proxy between the daemon and
// versitygw, with two images under the mounted prefix: the victim, whose
// requests get the faults, and a canary. Transient faults (503s, dropped
// connections) are retried and the read succeeds; a stall past
// --remote-timeout and an object replaced while open fail the read with
// EIO (and a log line) in bounded time. Through all of it the daemon stays
// up and the canary reads right. (A server ignoring Range:
// TestRemoteIgnoredRange.)
func TestRemoteFaults(t *testing.T) {
	harness.RequireFUSE(t)
	srv := startS3(t, "faults")
	work := qemu.TempDir(t)
	victim := qemu.Make(t, filepath.Join(work, "victim.qcow2"), "16M", "write -P 0x5a 0 16M")
	canary := qemu.Make(t, filepath.Join(work, "canary.qcow2"), "8M", "write -P 0xca 0 8M")
	putFile(t, srv, "faults", "img/victim.qcow2", victim)
	putFile(t, srv, "faults", "img/canary.qcow2", canary)
	wantVictim, err := os.ReadFile(wantRaw(t, work, victim))
	if err != nil {
		t.Fatal(err)
	}
	wantCanary, err := os.ReadFile(wantRaw(t, work, canary))
	if err != nil {
		t.Fatal(err)
	}

	proxy := servers.NewFaultProxy(t, srv.Endpoint)
	m := mountRemote(t, harness.Daemon{Env: s3Env(t, srv.Access, srv.Secret), Racy: true}, "s3://faults/img/",
		"--s3-endpoint", proxy.URL, "--remote-timeout=3s", "--remote-refresh=1h")
	vf := harness.Open(t, filepath.Join(m.Dir, "victim.raw"))
	cf := harness.Open(t, filepath.Join(m.Dir, "canary.raw"))

	// Each step reads its own MiB of the victim, so that neither the
	// kernel's page cache nor the chunk cache has it yet.
	region := int64(0)
	readVictim := func() error {
		region++
		buf := make([]byte, 64<<10)
		off := region << 20
		_, err := vf.ReadAt(buf, off)
		if err == nil && !bytes.Equal(buf, wantVictim[off:off+int64(len(buf))]) {
			t.Errorf("victim at %d: wrong bytes", off)
		}
		return err
	}
	canaryOff := int64(0)
	checkCanary := func(when string) {
		t.Helper()
		if !harness.IsMounted(m.Dir) {
			t.Fatalf("%s: the mount is gone", when)
		}
		buf := make([]byte, 256<<10)
		off := canaryOff % int64(len(wantCanary))
		canaryOff += 1 << 20
		if _, err := cf.ReadAt(buf, off); err != nil {
			t.Fatalf("%s: the canary: %v", when, err)
		}
		if !bytes.Equal(buf, wantCanary[off:off+int64(len(buf))]) {
			t.Fatalf("%s: the canary reads wrong bytes at %d", when, off)
		}
	}
	isVictim := func(r *http.Request) bool { return strings.Contains(r.URL.Path, "victim") }
	wantEIO := func(what string, within time.Duration) {
		t.Helper()
		start := time.Now()
		err := readVictim()
		if d := time.Since(start); d > within {
			t.Errorf("%s: the read took %v, want at most %v", what, d, within)
		}
		if !errors.Is(err, syscall.EIO) {
			t.Errorf("%s: the read returned %v, want EIO", what, err)
		}
	}
	checkCanary("before any fault")

	for _, f := range []servers.Fault{
		{Kind: servers.Status, Status: 503, Count: 3},
		{Kind: servers.Drop, After: 1000, Count: 2},
	} {
		proxy.Set(servers.Fault{Kind: f.Kind, Status: f.Status, After: f.After, Count: f.Count, Match: isVictim})
		before := proxy.Faulted()
		if err := readVictim(); err != nil {
			t.Errorf("%s: the read failed (%v); a transient fault should be retried", f.Kind, err)
		}
		if proxy.Faulted() == before {
			t.Errorf("%s: no request got the fault", f.Kind)
		}
		proxy.Clear()
		checkCanary(f.Kind.String())
	}

	// A stall: the read fails within the timeout (3 s) and some slack;
	// meanwhile the canary reads.
	proxy.Set(servers.Fault{Kind: servers.Stall, Match: isVictim})
	done := make(chan struct{})
	go func() {
		defer close(done)
		wantEIO("stall", 8*time.Second)
	}()
	harness.WaitFor(t, "a victim request held by the proxy", 5*time.Second, func() bool { return proxy.Held() > 0 })
	checkCanary("during a stall")
	<-done
	proxy.Clear()
	proxy.Release()
	// The timeout marked the object down: its reads fail at once until
	// the probe finds the server answering, which the daemon logs.
	harness.WaitFor(t, "the probe to find the server answering", 10*time.Second, func() bool {
		return strings.Contains(m.LogText(t), "the server answers again")
	})
	if err := readVictim(); err != nil {
		t.Errorf("after the stall: %v", err)
	}
	checkCanary("after a stall")

	// The object replaced while open: its reads fail, never mixing the
	// two versions.
	other := qemu.Make(t, filepath.Join(work, "other.qcow2"), "16M", "write -P 0x77 0 16M")
	putFile(t, srv, "faults", "img/victim.qcow2", other)
	wantEIO("replaced", 5*time.Second)
	checkCanary("after the replacement")

	log := m.LogText(t)
	for _, want := range []string{"timed out", "changed"} {
		if !strings.Contains(log, want) {
			t.Errorf("the daemon's log does not say %q:\n%s", want, log)
		}
	}
	if strings.Contains(log, srv.Secret) {
		t.Errorf("the daemon's log shows the secret key")
	}
}

// TestRemoteIgnoredRange: a web server that answers range requests with
// the whole body is refused with a clear message: at mount time (the
// mount fails, nothing is mounted), and mid-read (EIO and a log line; the
// daemon stays up, and reads work again once the server honours Range).
func TestRemoteIgnoredRange(t *testing.T) {
	root := harness.SourceDir(t)
	img := qemu.Make(t, filepath.Join(root, "disk.qcow2"), "16M", "write -P 0x5a 0 16M")
	want, err := os.ReadFile(wantRaw(t, t.TempDir(), img))
	if err != nil {
		t.Fatal(err)
	}
	ng := servers.StartNginx(t, root, false)
	proxy := servers.NewFaultProxy(t, ng.URL)
	url := proxy.URL + "/disk.qcow2"

	proxy.Set(servers.Fault{Kind: servers.IgnoreRange})
	if _, out, err := tryMountRemote(t, harness.Daemon{}, url); err == nil || !strings.Contains(out, "ignores Range") {
		t.Errorf("mount through a server ignoring Range: err %v, output %q; want a refusal", err, out)
	}
	proxy.Clear()

	m := mountRemote(t, harness.Daemon{}, url)
	f := harness.Open(t, filepath.Join(m.Dir, "disk.raw"))
	read := func(mib int64) error {
		buf := make([]byte, 64<<10)
		_, err := f.ReadAt(buf, mib<<20)
		if err == nil && !bytes.Equal(buf, want[mib<<20:mib<<20+int64(len(buf))]) {
			t.Errorf("wrong bytes at %d MiB", mib)
		}
		return err
	}
	if err := read(1); err != nil {
		t.Fatal(err)
	}
	proxy.Set(servers.Fault{Kind: servers.IgnoreRange})
	start := time.Now()
	if err := read(3); !errors.Is(err, syscall.EIO) {
		t.Errorf("read through a server ignoring Range: %v, want EIO", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("the refused read took %v", d)
	}
	proxy.Clear()
	if err := read(5); err != nil {
		t.Errorf("read once the server honours Range again: %v", err)
	}
	if log := m.LogText(t); !strings.Contains(log, "ignores Range") {
		t.Errorf("the daemon's log does not say the server ignores Range:\n%s", log)
	}
}

// TestRemoteGuestPartition loop-mounts the guest partition of an image
// served by nginx, through the mount, and checks every file's sha256.
func TestRemoteGuestPartition(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "sfdisk", "mkfs.ext4", "losetup", "partx", "mount")
	work := qemu.TempDir(t)
	want := harness.WriteGuestTree(t, filepath.Join(work, "tree"))
	disk := harness.MakeGuestDisk(t, work, filepath.Join(work, "tree"))
	root := qemu.TempDir(t)
	qemu.Img(t, "convert", "-q", "-f", "raw", "-O", "qcow2", disk, filepath.Join(root, "disk.qcow2"))
	ng := servers.StartNginx(t, root, false)
	// Cleanups run last first: the guest, the loop device, then qcowfs.
	m := mountRemote(t, harness.Daemon{}, ng.URL+"/disk.qcow2")
	dev, _ := harness.AttachLoop(t, filepath.Join(m.Dir, "disk.raw"), "-r", "-P")
	guest, _ := harness.MountGuest(t, harness.PartitionNode(t, dev), "ro,noload")
	harness.CompareTrees(t, harness.ReadTree(t, guest), want)
	if log := m.LogText(t); strings.Contains(log, "level=ERROR") {
		t.Errorf("the daemon logged errors:\n%s", log)
	}
}

// TestRemoteSeekSignalled: a signal the caller takes while its lseek
// waits on the server does not fail the lseek. The kernel sends the daemon
// a FUSE INTERRUPT on any signal (Go programs take SIGURG all the time);
// only a caller being killed gets EINTR (TestHostileWalks), any other
// its answer, qemu's. The image has 300 L2 tables of zero clusters before
// its data (tablesImage): SEEK_DATA from 0 walks long after the interrupt. The
// seeking thread is signalled once the proxy holds the requests and the
// thread sleeps in the FUSE request; the proxy lets the requests go once
// the thread has queued the interrupt (its state is then D, the kernel's
// killable wait).
func TestRemoteSeekSignalled(t *testing.T) {
	root := harness.SourceDir(t)
	img := tablesImage(t, root)
	want := qemu.DataRuns(t, img)[0][0]
	ng := servers.StartNginx(t, root, false)
	proxy := servers.NewFaultProxy(t, ng.URL)
	m := mountRemote(t, harness.Daemon{}, proxy.URL+"/tables.qcow2")
	proxy.Set(servers.Fault{Kind: servers.Stall})
	f := harness.Open(t, filepath.Join(m.Dir, "tables.raw"))

	type answer struct {
		off int64
		err error
	}
	tid := make(chan int, 1)
	done := make(chan answer, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		tid <- unix.Gettid()
		off, err := unix.Seek(int(f.Fd()), 0, unix.SEEK_DATA)
		done <- answer{off, err}
	}()
	th := <-tid
	harness.WaitFor(t, "the lseek to wait on the server", 10*time.Second, func() bool {
		if len(done) > 0 {
			t.Fatalf("the lseek answered without waiting on the server: %v", <-done)
		}
		return proxy.Held() > 0 && inFUSERequest(fmt.Sprintf("/proc/self/task/%d/wchan", th))
	})
	if err := unix.Tgkill(os.Getpid(), th, unix.SIGURG); err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, "the thread's killable wait", 10*time.Second, func() bool {
		_, state, _ := strings.Cut(threadFile(th, "stat"), ") ")
		return strings.HasPrefix(state, "D") || len(done) > 0
	})
	proxy.Clear()
	proxy.Release()
	if a := <-done; a.err != nil || a.off != want {
		t.Errorf("lseek(0, SEEK_DATA) signalled while it waited on the server: %d, %v; qemu's map: data from %d", a.off, a.err, want)
	}
}

// TestRemoteSeekKilled: a caller killed while its lseek walks the tables
// of an image over a slow link (100 ms a request, 256 KiB/s a response:
// the walk of tablesImage's 19 MiB of tables takes many seconds) is let go
// at once: the daemon ends the request before its next table on the
// kernel's interrupt.
func TestRemoteSeekKilled(t *testing.T) {
	root := harness.SourceDir(t)
	tablesImage(t, root)
	ng := servers.StartNginx(t, root, false)
	proxy := servers.NewFaultProxy(t, ng.URL)
	m := mountRemote(t, harness.Daemon{}, proxy.URL+"/tables.qcow2")
	proxy.Set(servers.Fault{Kind: servers.Delay, Delay: 100 * time.Millisecond, Rate: 256 << 10})
	t.Cleanup(proxy.Clear) // before the unmount
	s := harness.StartSeeker(t, filepath.Join(m.Dir, "tables.raw"))
	harness.WaitFor(t, "the seeker's lseek to wait on the daemon", 10*time.Second, func() bool {
		tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/wchan", s.Cmd.Process.Pid))
		return slices.ContainsFunc(tasks, inFUSERequest)
	})
	start := time.Now()
	s.Cmd.Process.Kill()
	exited := make(chan struct{})
	go func() {
		s.Cmd.Wait()
		close(exited)
	}()
	select {
	case <-exited:
		t.Logf("the killed seeker exited after %v", time.Since(start).Round(time.Millisecond))
	case <-time.After(5 * time.Second):
		t.Errorf("the killed seeker did not exit within 5 s: the daemon went on walking")
		proxy.Clear()
		<-exited
	}
}

// tablesImage makes tables.qcow2 in dir: 300 L2 tables of zero clusters
// (150 GiB), then one cluster of data. SEEK_DATA from 0 reads every table,
// most of them far from the header (a remote mount has not fetched them).
func tablesImage(t testing.TB, dir string) string {
	const tables = 300
	var cmds []string
	for i := range tables {
		cmds = append(cmds, fmt.Sprintf("write -z %dM 64k", i*512))
	}
	cmds = append(cmds, fmt.Sprintf("write -P 0x5a %dM 64k", tables*512))
	return qemu.Make(t, filepath.Join(dir, "tables.qcow2"), fmt.Sprintf("%dM", (tables+1)*512), cmds...)
}

// inFUSERequest reports whether the thread whose wchan file this is
// sleeps waiting for the answer to a FUSE request.
func inFUSERequest(wchan string) bool {
	b, _ := os.ReadFile(wchan)
	return strings.Contains(string(b), "request_wait_answer")
}

// threadFile is /proc/self/task/TID/NAME, "" if unreadable.
func threadFile(tid int, name string) string {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/self/task/%d/%s", tid, name))
	return string(b)
}
