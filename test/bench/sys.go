package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"
)

// errInterrupted is what a command returns when the bench was interrupted
// (Ctrl-C, SIGTERM) while it ran.
var errInterrupted = errors.New("interrupted")

// A cmd is one command to run: its own process group, so that a timeout or
// an interrupt kills it and everything it started (a shell pipeline), and
// nothing it starts receives the terminal's Ctrl-C before the bench has had
// a chance to unmount.
type cmd struct {
	name    string
	args    []string
	dir     string
	env     []string      // added to the environment
	stdin   io.Reader     // nil: /dev/null
	timeout time.Duration // 0: the bench's default
	// stuck is called when the command does not die within a few
	// seconds of being killed: a process blocked in the kernel on a hung
	// FUSE daemon (directly, or through a loop device) only wakes up when
	// the FUSE connection is aborted.
	stuck func()
	// cleanup marks a teardown command: it runs to completion (or its
	// timeout) even after the bench was interrupted.
	cleanup bool
	// outFile, when set, is the file its stdout and stderr go to instead
	// of pipes, read back as its stderr: for a command that leaves a
	// process holding them (a daemon's detached tracer, syscalls.go),
	// which pipes would wait for.
	outFile string
	// stall, when set, cuts the command off as stalled once none of its
	// processes has read or written a byte for that long (stalled.go),
	// before its timeout.
	stall time.Duration
}

func command(name string, args ...string) *cmd { return &cmd{name: name, args: args} }

func (c *cmd) String() string {
	s := shellQuote(append([]string{c.name}, c.args...))
	if len(c.env) > 0 {
		s = strings.Join(c.env, " ") + " " + s
	}
	return s
}

// A result is how a command went.
type result struct {
	elapsed        time.Duration // from start to exit
	stdout, stderr string
	err            error // nil, or why it failed (exit status with stderr, timeout, ...)
	timedOut       bool
	stalled        bool // cut off by cmd.stall (timedOut is set too)
	// exitCode is the exit status when the command exited by itself,
	// -1 when it did not (it could not start, was killed, timed out).
	exitCode int
}

// sample is a timed command's measurement of metric: its wall time, marked
// timed out (and errTimedOut) if it was killed, with the command's error
// if it failed.
func (r result) sample(metric string) (sample, error) {
	s := sample{metric: metric, seconds: r.elapsed.Seconds()}
	if r.timedOut {
		s.timedOut, s.stalled = true, r.stalled
		return s, fmt.Errorf("%w: %v", errTimedOut, r.err)
	}
	return s, r.err
}

// run runs c, bounded by its timeout and by the bench's context.
func (b *bench) run(c *cmd) result {
	timeout := c.timeout
	if timeout == 0 {
		timeout = b.cfg.timeout
	}
	ec := exec.Command(c.name, c.args...)
	ec.Dir = c.dir
	if len(c.env) > 0 {
		ec.Env = append(os.Environ(), c.env...)
	}
	ec.Stdin = c.stdin
	var stdout, stderr capBuffer
	stdout.max, stderr.max = 1<<20, 64<<10
	ec.Stdout, ec.Stderr = &stdout, &stderr
	var outF *os.File
	if c.outFile != "" {
		f, err := os.Create(c.outFile)
		if err != nil {
			return result{err: err, exitCode: -1}
		}
		defer f.Close()
		outF, ec.Stdout, ec.Stderr = f, f, f
	}
	ec.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	// Once the process has exited, do not wait long for anything it left
	// holding its output pipes.
	ec.WaitDelay = 5 * time.Second
	fmt.Fprintf(b.log, "%s $ %s\n", time.Now().Format("15:04:05.000"), c)

	start := time.Now()
	if err := ec.Start(); err != nil {
		return result{err: err, exitCode: -1}
	}
	done := make(chan error, 1)
	go func() { done <- ec.Wait() }()
	timer := time.NewTimer(timeout)
	defer timer.Stop()

	interrupt := b.ctx.Done()
	if c.cleanup {
		interrupt = nil
	}
	var stalled <-chan struct{}
	if c.stall > 0 {
		quit := make(chan struct{})
		defer close(quit)
		stalled = watchStall(ec.Process.Pid, c.stall, quit)
	}
	res := result{exitCode: -1}
	var werr error
	select {
	case werr = <-done:
		res.elapsed = time.Since(start)
		// Wait has returned: ProcessState is no longer written.
		if ps := ec.ProcessState; ps != nil {
			res.exitCode = ps.ExitCode()
		}
	case <-timer.C:
		res.elapsed = time.Since(start)
		res.timedOut = true
		werr = b.kill(ec, done, c.stuck)
	case <-stalled:
		res.elapsed = time.Since(start)
		res.timedOut, res.stalled = true, true
		werr = b.kill(ec, done, c.stuck)
	case <-interrupt:
		res.elapsed = time.Since(start)
		werr = b.kill(ec, done, c.stuck)
	}
	if outF != nil {
		outF.Seek(0, io.SeekStart)
		io.Copy(&stderr, outF)
	}
	res.stdout, res.stderr = stdout.String(), stderr.String()
	switch {
	case res.stalled:
		res.err = fmt.Errorf("stalled: no byte read or written for %.0f s; cut off after %.0f s", c.stall.Seconds(), res.elapsed.Seconds())
		if werr != nil && errors.Is(werr, errStuck) {
			res.err = fmt.Errorf("%w; %v", res.err, werr)
		}
	case res.timedOut:
		res.err = fmt.Errorf("timed out after %v", timeout.Round(time.Second))
		if werr != nil && errors.Is(werr, errStuck) {
			res.err = fmt.Errorf("%w; %v", res.err, werr)
		}
	case !c.cleanup && b.ctx.Err() != nil && werr != nil:
		res.err = errInterrupted
	case werr != nil:
		msg := lastLines(res.stderr, 3)
		if msg == "" {
			msg = lastLines(res.stdout, 3)
		}
		if msg != "" {
			res.err = fmt.Errorf("%s: %v: %s", c.name, werr, msg)
		} else {
			res.err = fmt.Errorf("%s: %v", c.name, werr)
		}
	}
	if res.err != nil {
		fmt.Fprintf(b.log, "    -> %v\n", res.err)
	}
	return res
}

var errStuck = errors.New("process did not die after SIGKILL (blocked in the kernel)")

// kill kills the command's process group and waits for it to go; if it
// does not go, stuck (when set) gets a chance to unblock it.
func (b *bench) kill(ec *exec.Cmd, done chan error, stuck func()) error {
	syscall.Kill(-ec.Process.Pid, syscall.SIGKILL)
	select {
	case err := <-done:
		return err
	case <-time.After(5 * time.Second):
	}
	if stuck != nil {
		stuck()
		select {
		case err := <-done:
			return err
		case <-time.After(15 * time.Second):
		}
	}
	return errStuck
}

// must runs c and returns its stdout, or an error naming the command.
func (b *bench) must(c *cmd) (string, error) {
	r := b.run(c)
	if r.err != nil {
		return r.stdout, fmt.Errorf("%s: %w", c, r.err)
	}
	return r.stdout, nil
}

// capBuffer keeps the first max bytes written to it and drops the rest.
type capBuffer struct {
	bytes.Buffer
	max int
}

func (c *capBuffer) Write(p []byte) (int, error) {
	if room := c.max - c.Len(); room > 0 {
		c.Buffer.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}

// shellQuote renders argv as a shell command line a reader can paste.
func shellQuote(argv []string) string {
	out := make([]string, len(argv))
	for i, a := range argv {
		if a != "" && strings.IndexFunc(a, func(r rune) bool {
			return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_./=:,+@%", r))
		}) < 0 {
			out[i] = a
		} else {
			out[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		}
	}
	return strings.Join(out, " ")
}

// waitUntil polls cond every 20 ms until it holds, d passes or the bench is
// interrupted.
func (b *bench) waitUntil(ctx context.Context, d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
}
