package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/internal/mountinfo"
)

// The control socket: a unix socket in the runtime folder named after the
// mount point (mnt-vms.sock), mode 0600 in a folder of mode 0700, on
// which the daemon answers "status\n" with one line of JSON. Only the
// daemon's own user and root are answered (SO_PEERCRED).

// controlPath is where the daemon serving mountpoint listens. A unix
// socket's path is at most maxSocketPath bytes (sun_path, unix(7)): for a
// deep mount point the name is cut, and a hash of the whole mount point
// keeps it its own (srv-some-long-pa~0123456789abcdef.sock).
func controlPath(mountpoint string) string {
	dir, name := runtimeDir(), runtimeName(mountpoint, "")
	const suffix, hashLen = ".sock", 1 + 16
	if p := filepath.Join(dir, name+suffix); len(p) <= maxSocketPath {
		return p
	}
	keep := maxSocketPath - len(dir) - 1 - hashLen - len(suffix)
	if keep < 0 {
		keep = 0 // the folder alone is too long: listen says so
	}
	h := fnv.New64a()
	h.Write([]byte(filepath.Clean(mountpoint)))
	return filepath.Join(dir, fmt.Sprintf("%s~%016x%s", name[:min(keep, len(name))], h.Sum64(), suffix))
}

// maxSocketPath is the longest path a unix socket can have: sun_path's
// 108 bytes with the terminating NUL.
const maxSocketPath = 107

// startControl serves status() on the mount's control socket until the
// returned function is called.
func startControl(mountpoint string, status func() any, logger *slog.Logger) (func(), error) {
	if _, err := makeRuntimeDir(); err != nil {
		return nil, err
	}
	path := controlPath(mountpoint)
	// The mount point was not mounted (preflight), so a socket there
	// is a dead daemon's.
	os.Remove(path)
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, err
	}
	l.SetUnlinkOnClose(true)
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return nil, err
	}
	go func() {
		for {
			conn, err := l.AcceptUnix()
			if err != nil {
				return
			}
			go answer(conn, status, logger)
		}
	}()
	return func() { l.Close() }, nil
}

func answer(conn *net.UnixConn, status func() any, logger *slog.Logger) {
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(5 * time.Second))
	if err := peerAllowed(conn); err != nil {
		fmt.Fprintf(conn, "{\"error\": %q}\n", err.Error())
		return
	}
	req, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		return
	}
	switch strings.TrimSpace(req) {
	case "status":
		b, err := json.Marshal(status())
		if err != nil {
			logger.Error("status", "err", err)
			return
		}
		conn.Write(append(b, '\n'))
	default:
		fmt.Fprintf(conn, "{\"error\": %q}\n", "unknown request "+strings.TrimSpace(req))
	}
}

// peerAllowed admits the daemon's own user and root.
func peerAllowed(conn *net.UnixConn) error {
	raw, err := conn.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var cerr error
	raw.Control(func(fd uintptr) { cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) })
	if cerr != nil {
		return cerr
	}
	if cred.Uid != 0 && int(cred.Uid) != os.Geteuid() {
		return errors.New("permission denied: not the mount's owner")
	}
	return nil
}

// qcowfsMount returns the absolute, symlink-free path of the qcowfs mount
// at path (as the control socket is named after it), or an error saying
// that nothing, or another file system, is mounted there.
func qcowfsMount(path string) (string, error) {
	mnt, err := filepath.Abs(path)
	if err != nil {
		return "", err
	}
	if real, err := filepath.EvalSymlinks(mnt); err == nil {
		mnt = real
	}
	m, err := mountinfo.At(mnt)
	if err != nil {
		return "", err
	}
	if m == nil {
		return "", fmt.Errorf("%s: not mounted", path)
	}
	if m.FSType != "fuse.qcowfs" {
		return "", fmt.Errorf("%s: a %s mount, not a qcowfs one", path, m.FSType)
	}
	return mnt, nil
}

// askControl sends a request to the daemon serving mountpoint and
// returns its one-line answer.
func askControl(mountpoint, req string) ([]byte, error) {
	path := controlPath(mountpoint)
	conn, err := net.DialTimeout("unix", path, 5*time.Second)
	if err != nil {
		return nil, fmt.Errorf("%s: no daemon answers on %s: %w", mountpoint, path, err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := fmt.Fprintf(conn, "%s\n", req); err != nil {
		return nil, err
	}
	line, err := bufio.NewReader(conn).ReadBytes('\n')
	if err != nil {
		return nil, fmt.Errorf("%s: reading the daemon's answer: %w", mountpoint, err)
	}
	var e struct {
		Error string `json:"error"`
	}
	if json.Unmarshal(line, &e) == nil && e.Error != "" {
		return nil, fmt.Errorf("%s: the daemon says: %s", mountpoint, e.Error)
	}
	return line, nil
}
