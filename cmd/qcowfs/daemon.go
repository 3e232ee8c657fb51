package main

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
)

// The daemon reports to the parent that waits for it on the ready pipe,
// one line each:
//
//	say: TEXT     a line for the user's stderr (where the log goes, a
//	              refused image, ...), printed as "qcowfs: TEXT"
//	ok            the mount is live
//	error: TEXT   mounting failed; nothing is mounted
//	exit          the daemon exits 0 without mounting (nofail)
const (
	readySay   = "say: "
	readyOK    = "ok"
	readyError = "error: "
	readyExit  = "exit"
)

// reportFailure ends a command that may be the daemon. If this is the
// daemon (ready is not nil), err (or, if nil, a clean exit) goes to the
// waiting parent and the daemon exits with the status the parent will;
// otherwise err is returned as it is.
func reportFailure(ready *os.File, err error) error {
	if ready == nil {
		return err
	}
	if err == nil {
		fmt.Fprintln(ready, readyExit)
		ready.Close()
		return nil
	}
	code := exitFailure
	var ee *exitError
	if errors.As(err, &ee) {
		code = ee.code
	}
	fmt.Fprintf(ready, "%s%d %s\n", readyError, code, oneLine(err.Error()))
	ready.Close()
	return &exitError{code: code}
}

// oneLine joins the lines of a message (fusermount3's output can have
// several) so that it stays one line of the protocol and of stderr.
func oneLine(s string) string {
	return strings.Join(strings.Fields(strings.ReplaceAll(s, "\n", " ")), " ")
}

// daemonize re-executes this program as the daemon, with the same
// arguments and working folder, and waits for it to report that the mount
// is live, or why it failed.
func (c *mountCmd) daemonize(inv *invocation) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	r, w, err := os.Pipe()
	if err != nil {
		return err
	}
	devnull, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer devnull.Close()
	// The daemon parses what this process parsed, with -o options
	// already turned into flags, in the same working folder: it cannot
	// understand them differently (and its parent is not mount.fuse3).
	cmd := exec.Command(exe, inv.args[1:]...)
	cmd.Env = append(os.Environ(), daemonEnv+"=1")
	cmd.ExtraFiles = []*os.File{w}
	if c.KeyFile != "" {
		// The --key-file's bytes, on fd 4 (keyFD), through a pipe
		// (written meanwhile: the pipe's buffer may be smaller).
		kr, kw, err := os.Pipe()
		if err != nil {
			return err
		}
		defer kr.Close()
		go func() {
			c.keys.WriteFileKey(kw)
			kw.Close()
		}()
		cmd.Env = append(cmd.Env, keyEnv+"=1")
		cmd.ExtraFiles = append(cmd.ExtraFiles, kr)
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = devnull, devnull, devnull
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return err
	}
	w.Close()
	if len(cmd.ExtraFiles) > 1 {
		cmd.ExtraFiles[1].Close()
	}
	defer r.Close()
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == readyOK:
			return cmd.Process.Release()
		case line == readyExit:
			cmd.Wait()
			return nil
		case strings.HasPrefix(line, readyError):
			cmd.Wait()
			msg := strings.TrimPrefix(line, readyError)
			code := exitFailure
			if n, rest, ok := strings.Cut(msg, " "); ok {
				if _, err := fmt.Sscanf(n, "%d", &code); err == nil {
					msg = rest
				}
			}
			return &exitError{code: code, err: errors.New(msg)}
		default:
			fmt.Fprintln(os.Stderr, "qcowfs:", strings.TrimPrefix(line, readySay))
		}
	}
	err = cmd.Wait()
	return fmt.Errorf("the daemon exited before the mount was live: %v", err)
}
