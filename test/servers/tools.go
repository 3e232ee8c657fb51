package servers

import (
	"context"
	"fmt"
	"go/build"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Require returns the path of the program name, looked up in PATH and in
// $(go env GOPATH)/bin (where `go install` puts versitygw). If it is
// missing, the test is skipped, or fails under CI=true.
func Require(t testing.TB, name string) string {
	t.Helper()
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	for _, dir := range []string{"/usr/sbin", "/sbin", filepath.Join(build.Default.GOPATH, "bin")} {
		p := filepath.Join(dir, name)
		if st, err := os.Stat(p); err == nil && !st.IsDir() && st.Mode()&0o111 != 0 {
			return p
		}
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("%s is required under CI=true (.ci/run installs it) but is not installed", name)
	}
	t.Skipf("%s not installed; `make test` installs it", name)
	return ""
}

// freePort returns a TCP port that was free on 127.0.0.1 a moment ago.
// The server started on it may still lose a race for it: starters retry.
func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("no free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// process is a server child process.
type process struct {
	name   string
	cmd    *exec.Cmd
	exited chan struct{}
	err    error // after exited
	out    string
}

// start runs cmd, its output going to logFile.
func start(t testing.TB, name string, cmd *exec.Cmd, logFile string) *process {
	t.Helper()
	f, err := os.Create(logFile)
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		t.Fatalf("start %s: %v", name, err)
	}
	p := &process{name: name, cmd: cmd, exited: make(chan struct{}), out: logFile}
	go func() {
		p.err = cmd.Wait()
		f.Close()
		close(p.exited)
	}()
	return p
}

// stop ends the process: SIGTERM, then SIGKILL after 5 s.
func (p *process) stop() {
	select {
	case <-p.exited:
		return
	default:
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(5 * time.Second):
		p.cmd.Process.Kill()
		<-p.exited
	}
}

// output returns the end of the process's log.
func (p *process) output() string {
	b, _ := os.ReadFile(p.out)
	s := strings.TrimSpace(string(b))
	if len(s) > 2000 {
		s = "..." + s[len(s)-2000:]
	}
	return s
}

// waitUp polls ready until it succeeds, the process exits, or 15 s pass.
func (p *process) waitUp(ready func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		err := ready(ctx)
		if err == nil {
			return nil
		}
		select {
		case <-p.exited:
			return fmt.Errorf("%s exited (%v): %s", p.name, p.err, p.output())
		case <-ctx.Done():
			return fmt.Errorf("%s not up after 15 s: %v: %s", p.name, err, p.output())
		case <-tick.C:
		}
	}
}

func dialReady(addr string) func(context.Context) error {
	return func(ctx context.Context) error {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			c.Close()
		}
		return err
	}
}
