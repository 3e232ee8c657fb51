package hostile

import (
	"bytes"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// The harness of the hostile tests: every probe of a mount has a timeout
// (harness.Within), canary images sit beside the bad ones, the daemon's
// memory and descriptors are read from /proc (harness.ReadProc), and
// `qcowfs info|map|check` run on every hostile image under `timeout` and
// GNU time (bounded).

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
func errIs(err error, errno syscall.Errno) bool { return errors.Is(err, errno) }
