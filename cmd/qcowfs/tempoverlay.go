package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Throwaway overlays (--writable --overlay=temp), as qemu-nbd --snapshot
// makes them: every image is writable, and its writes go to an overlay in
// a folder of the daemon's own, made when it starts and removed when it
// ends. The folder lies on disk, not in memory: under $TMPDIR if set,
// else /var/tmp (where qemu puts its temporary snapshots; /tmp and the
// runtime folder are often tmpfs), in a folder of the user's own,
// qcowfs-UID (mode 0700), named overlays-PID-START-BOOT after the daemon:
// its process ID, its start time (in clock ticks since boot, from
// /proc/PID/stat) and the boot's ID. A daemon killed (kill -9, a crash)
// cannot remove its folder; the next qcowfs mount or unmount does, by
// finding its owner gone: no live process with that ID and start time in
// this boot. So folders never pile up beyond the daemons alive and the
// last ones killed.

// tempOverlay is the --overlay value that asks for throwaway overlays.
const tempOverlay = "temp"

// tempOverlayRoot is the user's folder of throwaway overlay folders.
func tempOverlayRoot() string {
	dir := os.Getenv("TMPDIR")
	if dir == "" {
		dir = "/var/tmp"
	}
	return filepath.Join(dir, fmt.Sprintf("qcowfs-%d", os.Geteuid()))
}

// makeTempOverlayRoot makes the user's folder (mode 0700) and refuses
// one that is not a folder of the user's own that only it may write to:
// another user could otherwise read the overlays, or put files of theirs
// in our place.
func makeTempOverlayRoot() (string, error) {
	root := tempOverlayRoot()
	if err := os.Mkdir(root, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return "", fmt.Errorf("folder for throwaway overlays: %w", err)
	}
	var st unix.Stat_t
	if err := unix.Lstat(root, &st); err != nil {
		return "", fmt.Errorf("folder for throwaway overlays: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR || int(st.Uid) != os.Geteuid() || st.Mode&0o077 != 0 {
		return "", fmt.Errorf("folder for throwaway overlays %s: not a folder of uid %d that only it may use (mode %#o, owner %d)", root, os.Geteuid(), st.Mode&0o7777, st.Uid)
	}
	return root, nil
}

// makeTempOverlayDir makes this process's folder of throwaway overlays,
// after removing the folders of daemons that are gone.
func makeTempOverlayDir() (string, error) {
	root, err := makeTempOverlayRoot()
	if err != nil {
		return "", err
	}
	removeStaleTempOverlays()
	me, err := processTag(os.Getpid())
	if err != nil {
		return "", fmt.Errorf("folder for throwaway overlays: %w", err)
	}
	dir := filepath.Join(root, "overlays-"+me)
	if err := os.Mkdir(dir, 0o700); err != nil {
		return "", fmt.Errorf("folder for throwaway overlays: %w", err)
	}
	return dir, nil
}

// removeStaleTempOverlays removes the throwaway overlay folders of the
// user's daemons that are gone (killed before they could remove them).
// Failures are ignored: the next run tries again.
func removeStaleTempOverlays() {
	root := tempOverlayRoot()
	names, err := os.ReadDir(root)
	if err != nil {
		return
	}
	for _, e := range names {
		tag, ok := strings.CutPrefix(e.Name(), "overlays-")
		if !ok || !e.IsDir() {
			continue
		}
		pid, err := strconv.Atoi(strings.SplitN(tag, "-", 2)[0])
		if err != nil {
			continue
		}
		if now, err := processTag(pid); err == nil && now == tag {
			continue // its daemon is alive
		}
		os.RemoveAll(filepath.Join(root, e.Name()))
	}
}

// processTag names the process pid for as long as it lives: its ID, its
// start time and the boot's ID, "PID-START-BOOT". An error means there
// is no such process, or only its zombie.
func processTag(pid int) (string, error) {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return "", err
	}
	// The command name, in parentheses, may hold spaces: the fields
	// after it start with field 3 (state); the start time is field 22.
	i := strings.LastIndexByte(string(stat), ')')
	if i < 0 {
		return "", fmt.Errorf("/proc/%d/stat: no command name", pid)
	}
	f := strings.Fields(string(stat[i+1:]))
	if len(f) < 20 {
		return "", fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f)+2)
	}
	if f[0] == "Z" || f[0] == "X" {
		// Dead, not yet reaped (a container's init may never reap
		// it): it uses its folder no more.
		return "", fmt.Errorf("process %d is dead (state %s)", pid, f[0])
	}
	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return "", err
	}
	b := strings.ReplaceAll(strings.TrimSpace(string(boot)), "-", "")
	return fmt.Sprintf("%d-%s-%s", pid, f[19], b[:min(8, len(b))]), nil
}
