// Package hostile tests hostile images and sources: fields at their
// limits, huge tables, corrupt and oversized compressed clusters, stuck
// disks, swapped folders; the daemon's time, memory and descriptors stay
// bounded.
package hostile

// TestMain, and the harness of the hostile tests: every probe of a mount
// has a timeout (harness.Within), canary images sit beside the bad ones,
// the daemon's memory and descriptors are read from /proc
// (harness.ReadProc), and `qcowfs info|map|check` run on every hostile
// image under `timeout` and GNU time (bounded).

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

func TestMain(m *testing.M) { harness.Main(m) }

// makeCanary makes canary.qcow2 in dir, 1 MiB of 0x61: the good image
// that sits beside the hostile ones.
func makeCanary(t testing.TB, dir string) {
	t.Helper()
	qemu.Make(t, filepath.Join(dir, "canary.qcow2"), "1M", "write -P 0x61 0 1M")
}

// checkCanary fails the test unless canary.raw in dir (of a mount) reads
// whole, as makeCanary made it, within probeImage's timeout.
func checkCanary(t testing.TB, dir string) {
	t.Helper()
	b, err := probeImage(t, filepath.Join(dir, "canary.raw"))
	if err != nil || len(b) != 1<<20 || b[0] != 0x61 {
		t.Errorf("the canary: %d bytes, %v", len(b), err)
	}
}

// sameWithin is harness.SameFile within d: the mount answers a whole read
// of a hostile image, and with qemu's bytes.
func sameWithin(t testing.TB, got, want string, d time.Duration) {
	t.Helper()
	harness.Within(t, "reading "+got, d, func() (int, error) {
		harness.SameFile(t, got, want)
		return 0, nil
	})
}

// peakWithin fails the test if the daemon pid's peak memory is over mib
// MiB (harness.MemBound), and logs what /proc says of it.
func peakWithin(t testing.TB, pid int, mib int64) {
	t.Helper()
	p := harness.ReadProc(t, pid)
	t.Logf("daemon: %v", p)
	if p.HWMKB > harness.MemBound(mib) {
		t.Errorf("the daemon peaked at %d MiB", p.HWMKB>>10)
	}
}

// listWithin lists dir (names, sorted) within d.
func listWithin(t testing.TB, dir string, d time.Duration) []string {
	t.Helper()
	got, err := harness.Within(t, "listing "+dir, d, func() ([]string, error) { return harness.ReadNames(dir) })
	if err != nil {
		t.Fatalf("listing %s: %v", dir, err)
	}
	return got
}

// boundedRun is one bounded run of qcowfs info, map or check.
type boundedRun struct {
	code   int
	rssKB  int64
	wall   time.Duration
	stderr string
}

// maxRSS bounds the memory of one qcowfs info|map|check run on a
// hostile image (a function: TestMain decides about the race detector).
func maxRSS() int64 { return harness.MemBound(192) }

// bounded runs `qcowfs info|map|check` on image under timeout and GNU
// time, and fails the test if one panics, is killed by the timeout or
// takes more than maxRSS. It returns the three runs.
func bounded(t testing.TB, image string) map[string]boundedRun {
	t.Helper()
	qemu.Require(t, "/usr/bin/time", "timeout")
	out := map[string]boundedRun{}
	for _, cmd := range [][]string{{"info", "--output=json"}, {"map", "--output=json"}, {"check", "--output=json"}} {
		args := append([]string{"-f", "time: %M %e", "timeout", "-s", "KILL", "120", harness.Bin()}, append(cmd, image)...)
		c := exec.Command("/usr/bin/time", args...)
		var stderr bytes.Buffer
		c.Stdout, c.Stderr = nil, &stderr // the map of a hostile image can be large: not kept
		err := c.Run()
		r := boundedRun{code: c.ProcessState.ExitCode()}
		text := stderr.String()
		if i := strings.LastIndex(text, "time: "); i >= 0 {
			var secs float64
			fmt.Sscanf(text[i:], "time: %d %f", &r.rssKB, &secs)
			r.wall = time.Duration(secs * float64(time.Second))
			text = text[:i]
		}
		r.stderr = text
		var ee *exec.ExitError
		switch {
		case errors.As(err, &ee) && (r.code == 124 || r.code == 137 || strings.Contains(text, "Command terminated by signal")):
			t.Errorf("qcowfs %s %s: killed or timed out (%v):\n%s", cmd[0], filepath.Base(image), err, text)
		case strings.Contains(text, "panic") || strings.Contains(text, "goroutine ") || strings.Contains(text, "fatal error"):
			t.Errorf("qcowfs %s %s crashed:\n%s", cmd[0], filepath.Base(image), text)
		case r.rssKB > maxRSS():
			t.Errorf("qcowfs %s %s took %d MiB (bound %d MiB)", cmd[0], filepath.Base(image), r.rssKB>>10, maxRSS()>>10)
		}
		out[cmd[0]] = r
	}
	return out
}

// boundedAll runs bounded on every image, two at a time, and logs
// the largest memory and time of each command.
func boundedAll(t testing.TB, images []string) {
	t.Helper()
	worst := map[string]boundedRun{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	work := make(chan string)
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for p := range work {
				runs := bounded(t, p)
				mu.Lock()
				for cmd, r := range runs {
					w := worst[cmd]
					w.rssKB, w.wall = max(w.rssKB, r.rssKB), max(w.wall, r.wall)
					worst[cmd] = w
				}
				mu.Unlock()
			}
		}()
	}
	for _, p := range images {
		work <- p
	}
	close(work)
	wg.Wait()
	for _, cmd := range []string{"info", "map", "check"} {
		t.Logf("qcowfs %s on %d hostile images: at most %d MiB, %v", cmd, len(images), worst[cmd].rssKB>>10, worst[cmd].wall.Round(time.Millisecond))
	}
}

// errIs reports whether err is errno.
func errIs(err error, errno unix.Errno) bool { return errors.Is(err, errno) }

// probeImage reads a served disk of at most 64 MiB whole (more: its first
// 4 MiB), and asks lseek where its data is, within timeouts; it returns
// the bytes read.
func probeImage(t testing.TB, path string) ([]byte, error) {
	t.Helper()
	return harness.Within(t, "probing "+path, 60*time.Second, func() ([]byte, error) {
		f, err := os.Open(path)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		st, err := f.Stat()
		if err != nil {
			return nil, err
		}
		for _, whence := range []int{unix.SEEK_DATA, unix.SEEK_HOLE} {
			if _, err := unix.Seek(int(f.Fd()), 0, whence); err != nil && err != unix.ENXIO {
				return nil, err
			}
		}
		n := min(st.Size(), 64<<20)
		if st.Size() > 64<<20 {
			n = 4 << 20
		}
		b := make([]byte, n)
		if k, err := f.ReadAt(b, 0); err != nil && !(err == io.EOF && int64(k) == n) {
			return nil, err
		}
		if st.Size() > 64<<20 {
			return nil, nil // not compared
		}
		return b, nil
	})
}

// qemuConvert returns what qemu-img convert makes of image (at most 64 MiB
// of it), or false if qemu cannot read it.
func qemuConvert(t testing.TB, image string) ([]byte, bool) {
	t.Helper()
	out := filepath.Join(t.TempDir(), "q.raw")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	info, err := exec.CommandContext(ctx, "qemu-img", "info", "--output=json", image).Output()
	if err != nil || !bytes.Contains(info, []byte(`"virtual-size"`)) {
		return nil, false
	}
	var size int64
	if i := bytes.Index(info, []byte(`"virtual-size": `)); i >= 0 {
		fmt.Sscanf(string(info[i+len(`"virtual-size": `):]), "%d", &size)
	}
	if size > 64<<20 {
		return nil, false
	}
	if err := exec.CommandContext(ctx, "qemu-img", "convert", "-O", "raw", image, out).Run(); err != nil {
		return nil, false
	}
	b, err := os.ReadFile(out)
	return b, err == nil
}

// readWithin reads n bytes at off of file, failing the test if the read
// does not answer within d: a hostile image must not hang the daemon.
func readWithin(t *testing.T, path string, off int64, n int, d time.Duration) ([]byte, error) {
	t.Helper()
	return harness.Within(t, fmt.Sprintf("reading %s at %d", path, off), d, func() ([]byte, error) {
		f, err := os.Open(path)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		b := make([]byte, n)
		k, err := f.ReadAt(b, off)
		return b[:k], err
	})
}

// seekAt is lseek(SEEK_DATA or SEEK_HOLE) of path at off, within 30 s.
func seekAt(t *testing.T, path string, off int64, whence int) (int64, error) {
	t.Helper()
	return harness.Within(t, fmt.Sprintf("lseek(%s, %d, %d)", filepath.Base(path), off, whence), 30*time.Second, func() (int64, error) {
		fd, err := unix.Open(path, unix.O_RDONLY, 0)
		if err != nil {
			return 0, err
		}
		defer unix.Close(fd)
		return unix.Seek(fd, off, whence)
	})
}

// waitIdle waits until the daemon uses less than 5% of a CPU over half a
// second: its background work (data counts) is done.
func waitIdle(t *testing.T, pid int) {
	t.Helper()
	harness.WaitFor(t, "the daemon to be idle", 120*time.Second, func() bool {
		c0 := harness.ReadProc(t, pid).CPU
		time.Sleep(500 * time.Millisecond)
		return harness.ReadProc(t, pid).CPU-c0 < 25*time.Millisecond
	})
}

// statAll lstats every name of dir, like ls -l, within d.
func statAll(t *testing.T, dir string, names []string, d time.Duration) {
	t.Helper()
	harness.Within(t, "stat of every name in "+dir, d, func() (int, error) {
		for _, n := range names {
			var st unix.Stat_t
			if err := unix.Lstat(filepath.Join(dir, n), &st); err != nil {
				return 0, fmt.Errorf("%s: %w", n, err)
			}
		}
		return 0, nil
	})
}
