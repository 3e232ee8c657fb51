package test

// Command line tests: the daemon and foreground mounts, signals, unmount.

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// TestCLIDaemonReady: "qcowfs mount" returns only once the mount is live.
// The checks right after it returns do not poll: the mount must be there.
func TestCLIDaemonReady(t *testing.T) {
	requireFUSE(t)
	src := t.TempDir()
	img, raw := cliImage(t, src, "vm")
	logFile := filepath.Join(t.TempDir(), "qcowfs.log")
	for i, source := range []string{src, src, img, img} {
		mnt := t.TempDir()
		cliCleanup(t, mnt)
		r := cliRun(t, "mount", "--log-file", logFile, source, mnt)
		cliWantOK(t, "qcowfs mount", r)
		if r.stdout != "" || r.stderr != "" {
			t.Errorf("qcowfs mount printed %q, %q; want silence", r.stdout, r.stderr)
		}
		m := cliMountAt(t, mnt)
		if m == nil || m.FSType != "fuse.qcowfs" {
			t.Fatalf("round %d: right after qcowfs mount returned, %s is mounted as %+v, want fuse.qcowfs", i, mnt, m)
		}
		if m.Source != source {
			t.Errorf("mount source %q, want %q", m.Source, source)
		}
		sameFile(t, filepath.Join(mnt, "vm.raw"), raw)
		cliWantOK(t, "qcowfs unmount", cliRun(t, "unmount", mnt))
		if cliMountAt(t, mnt) != nil {
			t.Fatalf("%s still mounted after qcowfs unmount returned", mnt)
		}
		cliWaitGone(t, mnt)
	}
}

// A cliForeground is a "qcowfs mount --foreground" process.
type cliForeground struct {
	cmd  *exec.Cmd
	done chan struct{}
	err  error  // Wait's result, once done is closed
	log  string // its stderr
}

func cliStartForeground(t testing.TB, src, mnt string) *cliForeground {
	t.Helper()
	cliCleanup(t, mnt)
	p := &cliForeground{done: make(chan struct{}), log: filepath.Join(t.TempDir(), "stderr")}
	logf, err := os.Create(p.log)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	p.cmd = exec.Command(qcowfsBin, "mount", "--foreground", "--log-level", "debug", src, mnt)
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
	waitFor(t, "the foreground mount", 10*time.Second, func() bool { return isMounted(mnt) || p.exited() })
	if p.exited() {
		t.Fatalf("qcowfs mount --foreground exited: %v\n%s", p.err, p.stderr(t))
	}
	if m := cliMountAt(t, mnt); m.FSType != "fuse.qcowfs" {
		t.Fatalf("%s mounted as %s", mnt, m.FSType)
	}
	return p
}

func (p *cliForeground) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (p *cliForeground) stderr(t testing.TB) string {
	b, _ := os.ReadFile(p.log)
	return string(b)
}

// wait waits for the process to exit and checks that it exited 0.
func (p *cliForeground) wait(t testing.TB, why string) {
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
	requireFUSE(t)
	src := t.TempDir()
	_, raw := cliImage(t, src, "vm")
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
		t.Run(sig.String(), func(t *testing.T) {
			mnt := t.TempDir()
			p := cliStartForeground(t, src, mnt)
			sameFile(t, filepath.Join(mnt, "vm.raw"), raw)
			if err := p.cmd.Process.Signal(sig); err != nil {
				t.Fatal(err)
			}
			p.wait(t, sig.String())
			if isMounted(mnt) {
				t.Fatalf("%s still mounted after qcowfs exited", mnt)
			}
		})
	}

	t.Run("busy", func(t *testing.T) {
		mnt := t.TempDir()
		p := cliStartForeground(t, src, mnt)
		f, err := os.Open(filepath.Join(mnt, "vm.raw"))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "the busy mount to be detached", 10*time.Second, func() bool { return !isMounted(mnt) })
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
	requireFUSE(t)
	src := t.TempDir()
	cliImage(t, src, "vm")

	t.Run("qcowfs", func(t *testing.T) {
		m := mountImages(t, src)
		cliCleanup(t, m.Dir)
		if len(cliDaemons(t, m.Dir)) != 1 {
			t.Fatalf("want one daemon for %s, have %v", m.Dir, cliDaemons(t, m.Dir))
		}
		r := cliRun(t, "unmount", m.Dir)
		cliWantOK(t, "qcowfs unmount", r)
		if r.stdout != "" || r.stderr != "" {
			t.Errorf("qcowfs unmount printed %q, %q; want silence", r.stdout, r.stderr)
		}
		if isMounted(m.Dir) {
			t.Fatalf("%s still mounted after qcowfs unmount", m.Dir)
		}
		cliWaitGone(t, m.Dir)
	})

	t.Run("relative_path_and_umount_alias", func(t *testing.T) {
		m := mountImages(t, src)
		cliCleanup(t, m.Dir)
		cmd := exec.Command(qcowfsBin, "umount", filepath.Base(m.Dir))
		cmd.Dir = filepath.Dir(m.Dir)
		cliWantOK(t, "qcowfs umount DIR (relative)", cliRunCmd(t, cmd))
		if isMounted(m.Dir) {
			t.Fatalf("%s still mounted", m.Dir)
		}
		cliWaitGone(t, m.Dir)
	})

	t.Run("busy", func(t *testing.T) {
		m := mountImages(t, src)
		cliCleanup(t, m.Dir)
		f, err := os.Open(filepath.Join(m.Dir, "vm.raw"))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		cliWantError(t, "qcowfs unmount (busy)", cliRun(t, "unmount", m.Dir), "busy", "--lazy")
		if !isMounted(m.Dir) {
			t.Fatalf("a refused unmount unmounted %s", m.Dir)
		}
		cliWantOK(t, "qcowfs unmount --lazy", cliRun(t, "unmount", "--lazy", m.Dir))
		if isMounted(m.Dir) {
			t.Fatalf("%s still mounted after unmount --lazy", m.Dir)
		}
		f.Close()
		cliWaitGone(t, m.Dir)
	})

	t.Run("not_a_mount", func(t *testing.T) {
		dir := t.TempDir()
		cliWantError(t, "qcowfs unmount (not mounted)", cliRun(t, "unmount", dir), dir, "not mounted")
		missing := filepath.Join(dir, "nosuch")
		cliWantError(t, "qcowfs unmount (missing)", cliRun(t, "unmount", missing), missing, "not mounted")
	})

	t.Run("tmpfs", func(t *testing.T) {
		dir := t.TempDir()
		cliTmpfs(t, dir)
		cliWantError(t, "qcowfs unmount (tmpfs)", cliRun(t, "unmount", dir), dir, "tmpfs", "not a qcowfs")
		if m := cliMountAt(t, dir); m == nil || m.FSType != "tmpfs" {
			t.Fatalf("the tmpfs on %s is gone: %+v", dir, m)
		}
	})
}
