package main

import (
	"fmt"
	"io"
	"log/slog"
	"log/syslog"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// Where a daemon logs: --log-file if given, else stderr in the foreground,
// else syslog, else (no /dev/log, as in most containers) a file in the
// runtime folder named after the mount point. The parent says where at
// mount time when it is that file, so the log is never thrown away
// unannounced.

// runtimeDir is the folder of a daemon's fallback log and control socket:
// /run/qcowfs as root, $XDG_RUNTIME_DIR/qcowfs otherwise, and without
// XDG_RUNTIME_DIR a folder of the user's own in the temporary folder.
func runtimeDir() string {
	if os.Geteuid() == 0 {
		return "/run/qcowfs"
	}
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "qcowfs")
	}
	return filepath.Join(os.TempDir(), fmt.Sprintf("qcowfs-%d", os.Geteuid()))
}

// makeRuntimeDir creates the runtime folder (mode 0700) and refuses one
// that someone else owns or that others may write to: they could put a
// socket or a log of theirs in our place. (The socket itself is 0600 and
// checks its peer.)
func makeRuntimeDir() (string, error) {
	dir := runtimeDir()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("runtime folder: %w", err)
	}
	var st unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		return "", fmt.Errorf("runtime folder: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR || int(st.Uid) != os.Geteuid() || st.Mode&0o022 != 0 {
		return "", fmt.Errorf("runtime folder %s: not a folder of uid %d that only it may write to (mode %#o, owner %d)", dir, os.Geteuid(), st.Mode&0o7777, st.Uid)
	}
	return dir, nil
}

// runtimeName names a mount point's file in the runtime folder, escaped
// the way systemd-escape --path does: /mnt/my vms -> mnt-my\x20vms, so
// that distinct mount points never share a name.
func runtimeName(mountpoint, suffix string) string {
	p := strings.Trim(filepath.Clean(mountpoint), "/")
	if p == "" {
		return "-" + suffix
	}
	var b strings.Builder
	for i := 0; i < len(p); i++ {
		c := p[i]
		switch {
		case c == '/':
			b.WriteByte('-')
		case c == '.' && i == 0, !(c == '_' || c == ':' || c == '.' || 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9'):
			fmt.Fprintf(&b, `\x%02x`, c)
		default:
			b.WriteByte(c)
		}
	}
	return b.String() + suffix
}

// A logFile is an append-only log file that SIGHUP reopens, so that
// logrotate can move it away.
type logFile struct {
	path string
	mu   sync.Mutex // guards f
	f    *os.File
	// stderr: make file descriptor 2 the log too, so that what Go
	// itself writes there (a panic) lands in the log (daemon only).
	stderr bool
}

func openLogFile(path string, stderr bool) (*logFile, error) {
	l := &logFile{path: path, stderr: stderr}
	if err := l.Reopen(); err != nil {
		return nil, err
	}
	return l, nil
}

func (l *logFile) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.f.Write(p)
}

// Reopen opens the log file's path again (creating it) and switches to
// it; the old file is closed.
func (l *logFile) Reopen() error {
	f, err := os.OpenFile(l.path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o640)
	if err != nil {
		return fmt.Errorf("log file: %w", err)
	}
	l.mu.Lock()
	old := l.f
	l.f = f
	if l.stderr {
		unix.Dup3(int(f.Fd()), 2, 0)
	}
	l.mu.Unlock()
	if old != nil {
		old.Close()
	}
	return nil
}

// A logDest is where the daemon's log goes.
type logDest struct {
	out  io.Writer
	file *logFile // nil unless the log is a file
	// where, for the user and for qcowfs status: a path, "syslog" or
	// "stderr".
	where string
	// fallback is set when the log went to the runtime folder because
	// there is no syslog.
	fallback bool
}

// logDestination opens the log for a mount.
func (c *mountCmd) logDestination(daemon bool) (*logDest, error) {
	switch {
	case c.LogFile != "":
		f, err := openLogFile(c.LogFile, daemon)
		if err != nil {
			return nil, err
		}
		return &logDest{out: f, file: f, where: c.LogFile}, nil
	case !daemon:
		return &logDest{out: os.Stderr, where: "stderr"}, nil
	}
	if w, err := syslog.New(syslog.LOG_DAEMON|syslog.LOG_INFO, "qcowfs"); err == nil {
		return &logDest{out: w, where: "syslog"}, nil
	}
	dir, err := makeRuntimeDir()
	if err != nil {
		return nil, fmt.Errorf("no syslog, and no folder for the log: %w (use --log-file)", err)
	}
	path := filepath.Join(dir, runtimeName(c.Mountpoint, ".log"))
	f, err := openLogFile(path, true)
	if err != nil {
		return nil, err
	}
	return &logDest{out: f, file: f, where: path, fallback: true}, nil
}

func (c *mountCmd) newLogger(out io.Writer) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(c.LogLevel)); err != nil {
		return nil, err
	}
	return slog.New(slog.NewTextHandler(out, &slog.HandlerOptions{Level: level})), nil
}

// captureStderr sends what is written to file descriptor 2 (by fusermount3,
// which inherits it) into a buffer until the returned function is called;
// that function puts fd 2 back and returns what was captured.
func captureStderr() (func() string, error) {
	saved, err := unix.Dup(2)
	if err != nil {
		return nil, err
	}
	r, w, err := os.Pipe()
	if err != nil {
		unix.Close(saved)
		return nil, err
	}
	if err := unix.Dup3(int(w.Fd()), 2, 0); err != nil {
		unix.Close(saved)
		r.Close()
		w.Close()
		return nil, err
	}
	w.Close()
	done := make(chan string)
	go func() {
		b, _ := io.ReadAll(r)
		r.Close()
		done <- string(b)
	}()
	return func() string {
		unix.Dup3(saved, 2, 0)
		unix.Close(saved)
		return <-done
	}, nil
}
