package cli

// Command line tests: the daemon and foreground mounts, signals, unmount.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestCLIDaemonReady: "qcowfs mount" returns only once the mount is live.
// The checks right after it returns do not poll: the mount must be there.
func TestCLIDaemonReady(t *testing.T) {
	harness.RequireFUSE(t)
	src := t.TempDir()
	img, raw := smallImage(t, src, "vm")
	logFile := filepath.Join(t.TempDir(), "qcowfs.log")
	for i, source := range []string{src, src, img, img} {
		mnt := t.TempDir()
		harness.Cleanup(t, mnt)
		r := harness.Run(t, "mount", "--log-file", logFile, source, mnt)
		harness.WantOK(t, "qcowfs mount", r)
		if r.Stdout != "" || r.Stderr != "" {
			t.Errorf("qcowfs mount printed %q, %q; want silence", r.Stdout, r.Stderr)
		}
		m := harness.MountAt(t, mnt)
		if m == nil || m.FSType != "fuse.qcowfs" {
			t.Fatalf("round %d: right after qcowfs mount returned, %s is mounted as %+v, want fuse.qcowfs", i, mnt, m)
		}
		if m.Source != source {
			t.Errorf("mount source %q, want %q", m.Source, source)
		}
		harness.SameFile(t, filepath.Join(mnt, "vm.raw"), raw)
		harness.WantUnmount(t, mnt)
	}
}

// A foreground is a "qcowfs mount --foreground" process.
type foreground struct {
	cmd  *exec.Cmd
	done chan struct{}
	err  error  // Wait's result, once done is closed
	log  string // its stderr
}

func startForeground(t testing.TB, src, mnt string) *foreground {
	t.Helper()
	harness.Cleanup(t, mnt)
	p := &foreground{done: make(chan struct{}), log: filepath.Join(t.TempDir(), "stderr")}
	logf, err := os.Create(p.log)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	p.cmd = exec.Command(harness.Bin(), "mount", "--foreground", "--log-level", "debug", src, mnt)
	p.cmd.Stdout, p.cmd.Stderr = logf, logf
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		if !p.exited() {
			p.cmd.Process.Kill()
			<-p.done
		}
	})
	harness.WaitFor(t, "the foreground mount", 10*time.Second, func() bool { return harness.IsMounted(mnt) || p.exited() })
	if p.exited() {
		t.Fatalf("qcowfs mount --foreground exited: %v\n%s", p.err, p.stderr(t))
	}
	if m := harness.MountAt(t, mnt); m.FSType != "fuse.qcowfs" {
		t.Fatalf("%s mounted as %s", mnt, m.FSType)
	}
	return p
}

func (p *foreground) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (p *foreground) stderr(t testing.TB) string {
	b, _ := os.ReadFile(p.log)
	return string(b)
}

// wait waits for the process to exit and checks that it exited 0.
func (p *foreground) wait(t testing.TB, why string) {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(15 * time.Second):
		t.Fatalf("qcowfs --foreground still running 15s after %s\n%s", why, p.stderr(t))
	}
	if p.err != nil {
		t.Fatalf("qcowfs --foreground after %s: %v, want exit status 0\n%s", why, p.err, p.stderr(t))
	}
}

// TestForegroundSignals: SIGTERM and SIGINT unmount and end a foreground
// mount with status 0, even while a file is held open.
func TestForegroundSignals(t *testing.T) {
	harness.RequireFUSE(t)
	src := t.TempDir()
	_, raw := smallImage(t, src, "vm")
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
		t.Run(sig.String(), func(t *testing.T) {
			mnt := t.TempDir()
			p := startForeground(t, src, mnt)
			harness.SameFile(t, filepath.Join(mnt, "vm.raw"), raw)
			if err := p.cmd.Process.Signal(sig); err != nil {
				t.Fatal(err)
			}
			p.wait(t, sig.String())
			if harness.IsMounted(mnt) {
				t.Fatalf("%s still mounted after qcowfs exited", mnt)
			}
		})
	}

	t.Run("busy", func(t *testing.T) {
		mnt := t.TempDir()
		p := startForeground(t, src, mnt)
		f := harness.Open(t, filepath.Join(mnt, "vm.raw"))
		if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		harness.WaitFor(t, "the busy mount to be detached", 10*time.Second, func() bool { return !harness.IsMounted(mnt) })
		// Detached, but the open file still reads, served by the
		// process, which must keep running until it is closed.
		want, err := os.ReadFile(raw)
		if err != nil {
			t.Fatal(err)
		}
		got := make([]byte, 200000)
		if n, err := f.ReadAt(got, 1200000); err != nil || !bytes.Equal(got[:n], want[1200000:1200000+n]) {
			t.Errorf("reading the open file after the detach: %d bytes, %v, or wrong bytes", n, err)
		}
		if p.exited() {
			t.Fatalf("qcowfs exited (%v) while a file was open\n%s", p.err, p.stderr(t))
		}
		f.Close()
		p.wait(t, "SIGTERM and closing the last open file")
	})
}

// TestUnmount: "qcowfs unmount" unmounts qcowfs mounts and refuses
// anything else.
func TestUnmount(t *testing.T) {
	harness.RequireFUSE(t)
	src := t.TempDir()
	smallImage(t, src, "vm")

	t.Run("qcowfs", func(t *testing.T) {
		m := harness.Mount(t, src)
		harness.Cleanup(t, m.Dir)
		if len(harness.Daemons(t, m.Dir)) != 1 {
			t.Fatalf("want one daemon for %s, have %v", m.Dir, harness.Daemons(t, m.Dir))
		}
		r := harness.Run(t, "unmount", m.Dir)
		harness.WantOK(t, "qcowfs unmount", r)
		if r.Stdout != "" || r.Stderr != "" {
			t.Errorf("qcowfs unmount printed %q, %q; want silence", r.Stdout, r.Stderr)
		}
		if harness.IsMounted(m.Dir) {
			t.Fatalf("%s still mounted after qcowfs unmount", m.Dir)
		}
		harness.WaitGone(t, m.Dir)
	})

	t.Run("relative_path_and_umount_alias", func(t *testing.T) {
		m := harness.Mount(t, src)
		harness.Cleanup(t, m.Dir)
		cmd := exec.Command(harness.Bin(), "umount", filepath.Base(m.Dir))
		cmd.Dir = filepath.Dir(m.Dir)
		harness.WantOK(t, "qcowfs umount DIR (relative)", harness.RunCmd(t, cmd))
		if harness.IsMounted(m.Dir) {
			t.Fatalf("%s still mounted", m.Dir)
		}
		harness.WaitGone(t, m.Dir)
	})

	t.Run("busy", func(t *testing.T) {
		m := harness.Mount(t, src)
		harness.Cleanup(t, m.Dir)
		f := harness.Open(t, filepath.Join(m.Dir, "vm.raw"))
		harness.WantError(t, "qcowfs unmount (busy)", harness.Run(t, "unmount", m.Dir), "busy", "--lazy")
		if !harness.IsMounted(m.Dir) {
			t.Fatalf("a refused unmount unmounted %s", m.Dir)
		}
		harness.WantOK(t, "qcowfs unmount --lazy", harness.Run(t, "unmount", "--lazy", m.Dir))
		if harness.IsMounted(m.Dir) {
			t.Fatalf("%s still mounted after unmount --lazy", m.Dir)
		}
		f.Close()
		harness.WaitGone(t, m.Dir)
	})

	t.Run("not_a_mount", func(t *testing.T) {
		dir := t.TempDir()
		harness.WantError(t, "qcowfs unmount (not mounted)", harness.Run(t, "unmount", dir), dir, "not mounted")
		missing := filepath.Join(dir, "nosuch")
		harness.WantError(t, "qcowfs unmount (missing)", harness.Run(t, "unmount", missing), missing, "not mounted")
	})

	t.Run("tmpfs", func(t *testing.T) {
		dir := t.TempDir()
		mountTmpfs(t, dir)
		harness.WantError(t, "qcowfs unmount (tmpfs)", harness.Run(t, "unmount", dir), dir, "tmpfs", "not a qcowfs")
		if m := harness.MountAt(t, dir); m == nil || m.FSType != "tmpfs" {
			t.Fatalf("the tmpfs on %s is gone: %+v", dir, m)
		}
	})
}

// TestMountReportsRefused: qcowfs mount of a folder prints one line for
// each image it does not show (which, why, the flag that shows it) and
// exits 0; qcowfs status says the same, and the mount's facts, in both
// formats, over the daemon's control socket (mode 0600).
func TestMountReportsRefused(t *testing.T) {
	harness.RequireFUSE(t)
	src := t.TempDir()
	_, goodRaw := smallImage(t, src, "good")
	outside := t.TempDir()
	over, _ := chainOutside(t, src, outside)
	corrupt := filepath.Join(src, "sub", "corrupt.qcow2")
	mkdir(t, src, "sub")
	qemu.Create(t, "qcow2", corrupt, "1M")
	qemu.SetIncompatible(t, corrupt, 2)
	locked, _ := smallImage(t, src, "locked")
	qemu.HoldOpen(t, locked)
	want := map[string]string{over: "--allow-backing-outside=" + outside, corrupt: "--allow-corrupt", locked: "--force-share"}

	mnt := t.TempDir()
	harness.Cleanup(t, mnt)
	logFile := filepath.Join(t.TempDir(), "log")
	r := harness.Run(t, "mount", "--log-file", logFile, src, mnt)
	harness.WantOK(t, "qcowfs mount", r)
	lines := strings.Split(strings.TrimSuffix(r.Stderr, "\n"), "\n")
	if len(lines) != len(want) {
		t.Errorf("qcowfs mount printed %d lines, want one per refused image (%d):\n%s", len(lines), len(want), r.Stderr)
	}
	for img, flag := range want {
		found := false
		for _, l := range lines {
			if strings.HasPrefix(l, "qcowfs: not shown: "+img+": ") && strings.Contains(l, flag) {
				found = true
			}
		}
		if !found {
			t.Errorf("no line says %s is not shown and names %s:\n%s", img, flag, r.Stderr)
		}
	}
	harness.SameFile(t, filepath.Join(mnt, "good.raw"), goodRaw)

	daemon := harness.DaemonOf(t, mnt)
	r = harness.Run(t, "status", "--output=json", mnt)
	harness.WantOK(t, "qcowfs status --output=json", r)
	var st struct {
		Source, Mountpoint, Log string
		PID                     int
		Started                 time.Time
		Refused                 []struct{ Image, Reason, Hint string }
	}
	if err := json.Unmarshal([]byte(r.Stdout), &st); err != nil {
		t.Fatalf("qcowfs status --output=json: %v\n%s", err, r.Stdout)
	}
	if st.Source != src || st.Mountpoint != mnt || st.PID != daemon || st.Log != logFile || time.Since(st.Started) > time.Minute {
		t.Errorf("qcowfs status: %+v; want source %s, mountpoint %s, pid %d, log %s, started just now", st, src, mnt, daemon, logFile)
	}
	if len(st.Refused) != len(want) {
		t.Errorf("qcowfs status lists %d refused images, want %d: %+v", len(st.Refused), len(want), st.Refused)
	}
	for _, ref := range st.Refused {
		if flag, ok := want[ref.Image]; !ok || !strings.Contains(ref.Reason+ref.Hint, flag) {
			t.Errorf("qcowfs status: refused %+v; want one of %v with its flag", ref, want)
		}
	}
	r = harness.Run(t, "status", mnt)
	harness.WantOK(t, "qcowfs status", r)
	for _, w := range []string{"source:      " + src, "mount point: " + mnt, fmt.Sprintf("pid %d", daemon), "not shown:   3 images", over} {
		if !strings.Contains(r.Stdout, w) {
			t.Errorf("qcowfs status does not say %q:\n%s", w, r.Stdout)
		}
	}
	// The socket is the owner's only.
	sock := filepath.Join("/run/qcowfs", harness.Escape(mnt)+".sock")
	if fi, err := os.Stat(sock); err != nil || fi.Mode().Perm() != 0o600 || fi.Mode()&os.ModeSocket == 0 {
		t.Errorf("control socket %s: %v, %v; want a socket of mode 0600", sock, fi.Mode(), err)
	}
	harness.WantUnmount(t, mnt)
	if _, err := os.Stat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("control socket %s left behind after unmount: %v", sock, err)
	}
	harness.WantError(t, "qcowfs status (unmounted)", harness.Run(t, "status", mnt), mnt, "not mounted")
	tmpfs := t.TempDir()
	mountTmpfs(t, tmpfs)
	harness.WantError(t, "qcowfs status (tmpfs)", harness.Run(t, "status", tmpfs), "not a qcowfs")
}

// TestDaemonLogFallback: without syslog the daemon logs to
// /run/qcowfs/MNT.log and says so once at mount time; SIGHUP reopens the
// file (logrotate moves it away first).
func TestDaemonLogFallback(t *testing.T) {
	harness.RequireFUSE(t)
	if _, err := os.Stat("/dev/log"); err == nil {
		t.Skip("this machine has syslog (/dev/log): the daemon logs there")
	}
	src := t.TempDir()
	smallImage(t, src, "vm")
	mnt := t.TempDir()
	harness.Cleanup(t, mnt)
	logFile := filepath.Join("/run/qcowfs", harness.Escape(mnt)+".log")
	os.Remove(logFile)
	r := harness.Run(t, "mount", src, mnt)
	harness.WantOK(t, "qcowfs mount", r)
	if want := "qcowfs: no syslog (/dev/log): the log is in " + logFile + "\n"; r.Stderr != want {
		t.Errorf("qcowfs mount said %q, want %q", r.Stderr, want)
	}
	b, err := os.ReadFile(logFile)
	if err != nil || !strings.Contains(string(b), "msg=mounted") || !strings.Contains(string(b), "mountpoint="+mnt) {
		t.Fatalf("log %s: %v\n%s", logFile, err, b)
	}
	rotated := logFile + ".1"
	if err := os.Rename(logFile, rotated); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(rotated); os.Remove(logFile) })
	daemon := harness.DaemonOf(t, mnt)
	syscall.Kill(daemon, syscall.SIGHUP)
	harness.WaitFor(t, "the daemon to reopen its log", 10*time.Second, func() bool {
		b, _ := os.ReadFile(logFile)
		return strings.Contains(string(b), "log file reopened")
	})
	harness.WantUnmount(t, mnt)
	now, _ := os.ReadFile(logFile)
	old, _ := os.ReadFile(rotated)
	if !strings.Contains(string(now), "msg=unmounted") || strings.Contains(string(old), "msg=unmounted") {
		t.Errorf("after SIGHUP the log goes to the new file:\nnew %s:\n%s\nold %s:\n%s", logFile, now, rotated, old)
	}
}

// TestKilledDaemonRecovery: after the daemon is killed the mount point is
// dead ("Transport endpoint is not connected"); qcowfs unmount -z clears
// it, as the README says, and the folder mounts again.
func TestKilledDaemonRecovery(t *testing.T) {
	harness.RequireFUSE(t)
	src := t.TempDir()
	_, raw := smallImage(t, src, "vm")
	mnt := t.TempDir()
	harness.Cleanup(t, mnt)
	logFile := filepath.Join(t.TempDir(), "log")
	harness.WantOK(t, "qcowfs mount", harness.Run(t, "mount", "--log-file", logFile, src, mnt))
	daemon := harness.DaemonOf(t, mnt)
	syscall.Kill(daemon, syscall.SIGKILL)
	harness.WaitGone(t, mnt)
	// (A request the kernel had queued when the connection died fails
	// with ECONNABORTED instead; over io_uring, one the kernel handed to
	// a ring entry of a thread already exiting, with ECANCELED: the
	// daemon's threads may still be exiting when its process looks gone.)
	if _, err := os.Stat(filepath.Join(mnt, "vm.raw")); !errors.Is(err, syscall.ENOTCONN) && !errors.Is(err, syscall.ECONNABORTED) &&
		!(harness.OverRing() && errors.Is(err, syscall.ECANCELED)) {
		t.Fatalf("stat in the dead mount: %v, want ENOTCONN", err)
	}
	harness.WantError(t, "qcowfs mount on the dead mount", harness.Run(t, "mount", src, mnt), "already a mount point", "qcowfs unmount")
	harness.WantOK(t, "qcowfs unmount -z", harness.Run(t, "unmount", "-z", mnt))
	if harness.MountAt(t, mnt) != nil {
		t.Fatalf("%s still mounted after qcowfs unmount -z", mnt)
	}
	harness.WantOK(t, "qcowfs mount again", harness.Run(t, "mount", "--log-file", logFile, src, mnt))
	harness.SameFile(t, filepath.Join(mnt, "vm.raw"), raw)
	harness.WantUnmount(t, mnt)
}

// TestStatusCounters: qcowfs status, in both formats, lists the images
// open in the mount with their open files and the reads the mount
// answered: after N bytes read through the mount (bytes qemu-img convert
// agrees with), the bytes counted grow by at least N, and the requests by
// at least one; once the files are closed, the image is no longer open.
// The images it refuses are listed with their reason, each named once.
func TestStatusCounters(t *testing.T) {
	src := harness.SourceDir(t)
	// Large enough that the kernel's readahead after the first read
	// does not reach the second.
	img := qemu.Make(t, filepath.Join(src, "vm.qcow2"), "256M", "write -P 0x5a 0 1M", "write -P 0xa5 200M 1M")
	raw := qemu.ToRaw(t, img, filepath.Join(t.TempDir(), "vm.raw"))
	corrupt := filepath.Join(src, "corrupt.qcow2")
	qemu.Create(t, "qcow2", corrupt, "1M")
	qemu.SetIncompatible(t, corrupt, 2)
	mnt := t.TempDir()
	harness.Cleanup(t, mnt)
	harness.WantOK(t, "qcowfs mount", harness.Run(t, "mount", "--log-file", filepath.Join(t.TempDir(), "log"), src, mnt))

	st, out := harness.StatusOf(t, mnt)
	if e := st.OpenEntry(img); e != nil && e.Handles != 0 {
		t.Errorf("before any open, status says %s has %d open files:\n%s", img, e.Handles, out)
	}
	if len(st.Refused) != 1 || st.Refused[0].Image != corrupt || !strings.Contains(st.Refused[0].Reason, "corrupt bit set") ||
		strings.Contains(st.Refused[0].Reason, corrupt) || st.Refused[0].Hint != "--allow-corrupt" {
		t.Errorf("status lists refused %+v; want %s alone, its reason (without its path again) and --allow-corrupt", st.Refused, corrupt)
	}

	qraw := harness.Open(t, raw)
	// readAt reads n bytes at off of f and checks them against qemu's.
	readAt := func(f *os.File, off, n int64) {
		t.Helper()
		buf, want := make([]byte, n), make([]byte, n)
		if _, err := f.ReadAt(buf, off); err != nil {
			t.Fatal(err)
		}
		if _, err := qraw.ReadAt(want, off); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(buf, want) {
			t.Fatalf("%s at %d: not the bytes qemu-img convert makes", f.Name(), off)
		}
	}
	f1 := harness.Open(t, filepath.Join(mnt, "vm.raw"))
	const n1 = 1<<20 + 12345
	readAt(f1, 0, n1)
	st, out = harness.StatusOf(t, mnt)
	e1 := st.OpenEntry(img)
	if e1 == nil || e1.Handles != 1 || e1.ReadRequests < 1 || e1.ReadBytes < n1 {
		t.Fatalf("after reading %d bytes through one open file, status says %+v; want 1 handle, at least one read and %d bytes:\n%s", n1, e1, n1, out)
	}

	// A second open file, reading what the first did not (the kernel
	// has not cached it): both counters grow.
	f2 := harness.Open(t, filepath.Join(mnt, "vm.raw"))
	const off2, n2 = 200<<20 - 4096, 512 << 10
	readAt(f2, off2, n2)
	st, out = harness.StatusOf(t, mnt)
	e2 := st.OpenEntry(img)
	if e2 == nil || e2.Handles != 2 || e2.ReadRequests <= e1.ReadRequests || e2.ReadBytes < e1.ReadBytes+n2 {
		t.Fatalf("after %d more bytes through a second open file, status says %+v (before: %+v); want 2 handles, more reads, %d bytes more:\n%s", n2, e2, e1, n2, out)
	}

	// The human form says the same.
	r := harness.Run(t, "status", mnt)
	harness.WantOK(t, "qcowfs status", r)
	line := regexp.MustCompile(`(?m)^  ` + regexp.QuoteMeta(img) + `: (\d+) handles?, (\d+) reads?, (\d+) bytes?$`).FindStringSubmatch(r.Stdout)
	if !strings.Contains(r.Stdout, "mode:        read-only\n") || !strings.Contains(r.Stdout, "errors:      0 reads, 0 writes failed since mount\n") {
		t.Errorf("qcowfs status of a read-only mount without errors does not say so:\n%s", r.Stdout)
	}
	if st.Writable || st.CacheMode != "" {
		t.Errorf("qcowfs status --output=json of a read-only mount: writable %v, cache mode %q", st.Writable, st.CacheMode)
	}
	if !strings.Contains(r.Stdout, "open:        1 image\n") || line == nil {
		t.Fatalf("qcowfs status does not list %s as the one open image, with handles, reads and bytes:\n%s", img, r.Stdout)
	}
	if h, _ := strconv.Atoi(line[1]); h != 2 {
		t.Errorf("qcowfs status says %s handles, want 2:\n%s", line[1], r.Stdout)
	}
	if b, _ := strconv.ParseInt(line[3], 10, 64); b < e2.ReadBytes {
		t.Errorf("qcowfs status says %d bytes, fewer than the %d of the JSON status before it:\n%s", b, e2.ReadBytes, r.Stdout)
	}
	if !strings.Contains(r.Stdout, "  "+corrupt+": corrupt bit set") || strings.Count(r.Stdout, corrupt) != 1 {
		t.Errorf("qcowfs status does not name %s once with its reason:\n%s", corrupt, r.Stdout)
	}

	// Closed: FUSE sends RELEASE after close returns.
	f1.Close()
	f2.Close()
	harness.WaitFor(t, "the image to be closed after its files are", 5*time.Second, func() bool {
		st, _ := harness.StatusOf(t, mnt)
		return st.OpenEntry(img) == nil
	})
}

// TestStatusWritable: qcowfs status of a writable mount says so, with its
// cache mode (and overlay folder); it lists each open image with whether it
// is open for writing and which of qemu's locks it holds, which qemu-io
// confirms (it cannot read an image open for writing, nor write one open
// for reading); and it counts the reads and writes that failed since the
// mount, per image and in all, with the last failure: a read of data that
// an L2 entry places in the L1 table, a write that would land on the
// refcount table (qemu.Damaged). Both formats; one key style in JSON.
func TestStatusWritable(t *testing.T) {
	src := harness.SourceDir(t)
	tmpl := qemu.TempDir(t)
	for _, im := range qemu.Damaged(t, tmpl) {
		switch im.Name {
		case "l2-into-l1":
			qemu.Run(t, "cp", im.Path, filepath.Join(src, "readbad.qcow2"))
		case "l2-into-reftable":
			qemu.Run(t, "cp", im.Path, filepath.Join(src, "writebad.qcow2"))
		}
	}
	good := filepath.Join(src, "good.qcow2")
	qemu.Create(t, "qcow2", good, "8M")
	readBad, writeBad := filepath.Join(src, "readbad.qcow2"), filepath.Join(src, "writebad.qcow2")
	m := harness.Mount(t, src, "--writable")

	st, out := harness.StatusOf(t, m.Dir)
	if !st.Writable || st.CacheMode != "writeback" || st.Overlay != "" || st.Images.ReadErrors+st.Images.WriteErrors != 0 || st.Images.LastError != nil {
		t.Errorf("qcowfs status of a fresh writable mount:\n%s", out)
	}

	harness.OpenFile(t, filepath.Join(m.Dir, "good.raw"), os.O_RDWR)
	fr := harness.Open(t, filepath.Join(m.Dir, "readbad.raw"))
	const cs = 65536
	if _, err := fr.ReadAt(make([]byte, 4096), 2*cs); !errors.Is(err, syscall.EIO) {
		t.Fatalf("reading data placed in the L1 table: %v, want EIO", err)
	}
	fw := harness.OpenFile(t, filepath.Join(m.Dir, "writebad.raw"), os.O_RDWR|syscall.O_DIRECT)
	buf, err := syscall.Mmap(-1, 0, 4096, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(buf)
	if _, err := fw.WriteAt(buf, 0); !errors.Is(err, syscall.EIO) {
		t.Fatalf("a write onto the refcount table: %v, want EIO", err)
	}

	// qemu's view of the locks: the image open for writing cannot be
	// read, the one open for reading cannot be written.
	qemu.WantLocked(t, `Failed to get shared "write" lock`, "qemu-io", "-r", "-f", "qcow2", "-c", "read 0 4k", good)
	qemu.WantLocked(t, `Failed to get "write" lock`, "qemu-io", "-f", "qcow2", "-c", "write 0 4k", readBad)

	st, out = harness.StatusOf(t, m.Dir)
	g, r, w := st.OpenEntry(good), st.OpenEntry(readBad), st.OpenEntry(writeBad)
	if g == nil || r == nil || w == nil {
		t.Fatalf("qcowfs status does not list the three open images:\n%s", out)
	}
	writer := []string{"consistent read", "write", "resize"}
	if !g.OpenForWriting || g.Writers != 1 || !slices.Equal(g.Locks.Held, writer) || !slices.Equal(g.Locks.NotShared, []string{"write", "resize"}) {
		t.Errorf("the image open for writing: %+v; want open for writing, holding %q, not sharing write and resize", *g, writer)
	}
	if r.OpenForWriting || !slices.Equal(r.Locks.Held, []string{"consistent read"}) || !slices.Equal(r.Locks.NotShared, []string{"write"}) {
		t.Errorf("the image open for reading: %+v; want open for reading, holding consistent read, not sharing write", *r)
	}
	if r.ReadErrors < 1 || r.WriteErrors != 0 || r.LastError == nil || r.LastError.Op != "read" || r.LastError.Offset != 2*cs ||
		!strings.Contains(r.LastError.Error, "overlaps the L1 table") {
		t.Errorf("the image that failed a read: %+v, last error %+v", r.Errors, r.LastError)
	}
	if w.WriteErrors < 1 || w.ReadErrors != 0 || w.LastError == nil || w.LastError.Op != "write" || !strings.Contains(w.LastError.Error, "refcount table") {
		t.Errorf("the image that failed a write: %+v, last error %+v", w.Errors, w.LastError)
	}
	if g.ReadErrors+g.WriteErrors != 0 {
		t.Errorf("the good image has errors: %+v", g.Errors)
	}
	all := st.Images.Errors
	if all.ReadErrors != r.ReadErrors || all.WriteErrors != w.WriteErrors || all.LastError == nil || all.LastError.Image != writeBad {
		t.Errorf("the mount's errors: %+v, last %+v; want the images' added up, the last one writebad's", all, all.LastError)
	}

	// The same in words (a failed write may be tried again meanwhile:
	// the counts are not compared).
	h := harness.Run(t, "status", m.Dir)
	harness.WantOK(t, "qcowfs status", h)
	if !regexp.MustCompile(`(?m)^errors:      [1-9]\d* reads?, [1-9]\d* writes? failed since mount; last: write of ` + regexp.QuoteMeta(writeBad) + ` `).MatchString(h.Stdout) {
		t.Errorf("qcowfs status does not count the failed reads and writes, naming the last:\n%s", h.Stdout)
	}
	for _, want := range []string{
		"mode:        writable, writeback cache\n",
		"  " + good + ": 1 handle, ",
		"    open for writing (1 handle); locks: consistent read, write, resize; not sharing write, resize\n",
		"    open for reading; locks: consistent read; not sharing write\n",
		fmt.Sprintf("    errors: %s, 0 writes failed since mount; last: read at %d (", plural(r.ReadErrors, "read"), 2*cs),
		"    errors: 0 reads, 0 writes failed since mount\n",
	} {
		if !strings.Contains(h.Stdout, want) {
			t.Errorf("qcowfs status does not say %q:\n%s", want, h.Stdout)
		}
	}

	// Without the writeback cache, into overlays.
	ov := filepath.Join(t.TempDir(), "ov")
	m2 := harness.Mount(t, src, "--writable", "--no-writeback-cache", "--overlay", ov)
	st, out = harness.StatusOf(t, m2.Dir)
	if !st.Writable || st.CacheMode != "writethrough" || st.Overlay != ov {
		t.Errorf("qcowfs status of a write-through overlay mount:\n%s", out)
	}
	if h := harness.Run(t, "status", m2.Dir); !strings.Contains(h.Stdout, "mode:        writable, writethrough cache, overlays in "+ov+"\n") {
		t.Errorf("qcowfs status of a write-through overlay mount:\n%s", h.Stdout)
	}
}

// plural says "1 read", "2 reads", as qcowfs status does.
func plural(n int64, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

// TestDaemonLogFallbackNotRoot: a user other than root, without syslog,
// gets the log in $XDG_RUNTIME_DIR/qcowfs/MNT.log (without XDG_RUNTIME_DIR,
// in a folder of its own in $TMPDIR, qcowfs-UID), the control socket
// beside it (mode 0600; for a deep mount point, named short enough for a
// unix socket), and qcowfs mount says where in one line; the user reads
// the disk, asks qcowfs status and unmounts.
//
// The mount is a real FUSE mount by fusermount3 as nobody. It is made in
// a private mount namespace, where a /dev/fuse nobody may open (the same
// device, mode 0666) is bound over the machine's, and a plain file over
// /dev/log if there is one (so there is no syslog); the test enters that
// namespace (the daemon's) with nsenter for what nobody does in the mount.
func TestDaemonLogFallbackNotRoot(t *testing.T) {
	harness.RequireFUSE(t)
	for _, tool := range []string{"setpriv", "unshare", "nsenter", "mknod", "fusermount3"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s not installed", tool)
		}
	}
	nobody, err := user.Lookup("nobody")
	if err != nil {
		t.Fatal("no user nobody")
	}
	uid, _ := strconv.Atoi(nobody.Uid)
	d, bin := binaryForOthers(t)
	src := mkdir(t, d, "images")
	img, raw := smallImage(t, src, "vm")
	os.Chmod(img, 0o644)
	want, err := os.ReadFile(raw)
	if err != nil {
		t.Fatal(err)
	}
	devDir := mkdir(t, d, "dev")
	mine := func(name string) string {
		p := mkdir(t, d, name)
		if err := os.Chown(p, uid, -1); err != nil {
			t.Fatal(err)
		}
		os.Chmod(p, 0o700)
		return p
	}
	const script = `set -e
mount -t tmpfs -o mode=0755 qcowfs-test "$1"
mknod -m 0666 "$1/fuse" c 10 229
mount --bind "$1/fuse" /dev/fuse
if [ -e /dev/log ]; then : > "$1/log"; mount --bind "$1/log" /dev/log; fi
shift
exec "$@"`
	asNobody := []string{"setpriv", "--reuid=" + nobody.Uid, "--regid=" + nobody.Gid, "--clear-groups"}

	for _, c := range []struct {
		name string
		env  func(string) (env, dir string) // the variable, and the folder qcowfs uses
	}{
		{"XDG_RUNTIME_DIR", func(p string) (string, string) { return "XDG_RUNTIME_DIR=" + p, filepath.Join(p, "qcowfs") }},
		{"TMPDIR", func(p string) (string, string) { return "TMPDIR=" + p, filepath.Join(p, "qcowfs-"+nobody.Uid) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			// A deep mount point: the socket's name must be cut to fit
			// a unix socket's path.
			mnt := mine("mnt-" + c.name + "-" + strings.Repeat("x", 64))
			varEnv, dir := c.env(mine("run-" + c.name))
			env := []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", varEnv}
			harness.Cleanup(t, mnt)
			logFile := filepath.Join(dir, harness.Escape(mnt)+".log")

			cmd := exec.Command("unshare", append(append([]string{"--mount", "--propagation", "private", "sh", "-c", script, "sh", devDir}, asNobody...), bin, "mount", src, mnt)...)
			cmd.Env = env
			r := harness.RunCmd(t, cmd)
			harness.WantOK(t, "qcowfs mount as nobody", r)
			if w := "qcowfs: no syslog (/dev/log): the log is in " + logFile + "\n"; r.Stderr != w {
				t.Errorf("qcowfs mount said %q, want %q", r.Stderr, w)
			}
			daemon := harness.DaemonOf(t, mnt)
			// What nobody runs in the daemon's mount namespace.
			inMount := func(args ...string) harness.Result {
				t.Helper()
				cmd := exec.Command("nsenter", append(append([]string{"--mount=/proc/" + strconv.Itoa(daemon) + "/ns/mnt", "--"}, asNobody...), args...)...)
				cmd.Env = env
				return harness.RunCmd(t, cmd)
			}

			socks, _ := filepath.Glob(filepath.Join(dir, "*.sock"))
			if len(socks) != 1 || len(socks[0]) > 107 {
				t.Fatalf("sockets in %s: %q; want one, its path at most 107 bytes (sun_path)", dir, socks)
			}
			sock := socks[0]
			for _, f := range []struct {
				path string
				mode os.FileMode
			}{{dir, os.ModeDir | 0o700}, {sock, os.ModeSocket | 0o600}} {
				fi, err := os.Lstat(f.path)
				if err != nil {
					t.Fatal(err)
				}
				if st := fi.Sys().(*syscall.Stat_t); fi.Mode()&(os.ModeType|os.ModePerm) != f.mode || int(st.Uid) != uid {
					t.Errorf("%s: mode %v, owner %d; want %v, owner nobody (%d)", f.path, fi.Mode(), st.Uid, f.mode, uid)
				}
			}
			if fi, err := os.Stat(logFile); err != nil || int(fi.Sys().(*syscall.Stat_t).Uid) != uid || fi.Mode().Perm()&0o077&^0o040 != 0 {
				t.Errorf("log %s: %v, %v; want nobody's, not for others", logFile, fi, err)
			}
			got := inMount("cat", filepath.Join(mnt, "vm.raw"))
			harness.WantOK(t, "cat vm.raw as nobody", got)
			if got.Stdout != string(want) {
				t.Errorf("vm.raw read by nobody is not what qemu-img convert makes (%d bytes, want %d)", len(got.Stdout), len(want))
			}
			r = inMount(bin, "status", mnt)
			harness.WantOK(t, "qcowfs status as nobody", r)
			if !strings.Contains(r.Stdout, "log:         "+logFile+"\n") {
				t.Errorf("qcowfs status does not name the log %s:\n%s", logFile, r.Stdout)
			}
			harness.WantOK(t, "qcowfs unmount as nobody", inMount(bin, "unmount", mnt))
			harness.WaitGone(t, mnt)
			log, err := os.ReadFile(logFile)
			if err != nil || !strings.Contains(string(log), "msg=mounted") || !strings.Contains(string(log), "mountpoint="+mnt) ||
				!strings.Contains(string(log), "msg=unmounted") {
				t.Errorf("log %s: %v; want the mount and the unmount:\n%s", logFile, err, log)
			}
			if _, err := os.Stat(sock); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("control socket %s left behind after unmount: %v", sock, err)
			}
		})
	}
}
