package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

type unmountCmd struct {
	Mountpoint string `arg:"" help:"Where qcowfs is mounted."`
	Lazy       bool   `short:"z" help:"Detach even if busy; the mount goes away once nothing uses it."`
}

func (c *unmountCmd) Help() string {
	return `Examples:

  qcowfs unmount /mnt/vms
  qcowfs unmount -z /mnt/vms      detach now, even if busy, or after the daemon was killed

After a killed daemon, the mount point answers "Transport endpoint is not
connected": qcowfs unmount -z MNT clears it, then mount again.`
}

func (c *unmountCmd) Run() error {
	mnt, err := qcowfsMount(c.Mountpoint)
	if err != nil {
		return err
	}
	pid := daemonPID(mnt)
	if err := unmount(mnt, c.Lazy); err != nil {
		return err
	}
	if !c.Lazy && pid > 0 {
		// The daemon writes back and closes its images as the mount
		// goes: return when it is done, so that what runs next (a
		// qemu-img on the images) finds them complete and unlocked.
		waitExit(pid, mnt)
	}
	// A killed daemon's throwaway overlays (tempoverlay.go).
	removeStaleTempOverlays()
	return nil
}

// daemonPID asks the daemon serving mnt for its process ID; 0 if none
// answers.
func daemonPID(mnt string) int {
	b, err := askControl(mnt, "status")
	if err != nil {
		return 0
	}
	var s struct {
		PID int `json:"pid"`
	}
	if json.Unmarshal(b, &s) != nil {
		return 0
	}
	return s.PID
}

// waitExit waits until process pid (a qcowfs daemon) is gone, saying so
// once if that takes long.
func waitExit(pid int, mnt string) {
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil || !strings.Contains(string(cmdline), "qcowfs") {
		return
	}
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return // gone already
	}
	defer unix.Close(fd)
	wait := func(ms int) bool {
		for {
			n, err := unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, ms)
			if err == unix.EINTR {
				continue
			}
			return err != nil || n > 0
		}
	}
	if wait(5000) {
		return
	}
	fmt.Fprintf(os.Stderr, "qcowfs: %s is unmounted; waiting for the daemon (pid %d) to finish writing its images back\n", mnt, pid)
	wait(-1)
}

// unmount detaches a FUSE mount: with umount2(2) as root, with fusermount3
// otherwise. The daemon notices and exits.
func unmount(mnt string, lazy bool) error {
	if os.Geteuid() == 0 {
		flags := 0
		if lazy {
			flags = syscall.MNT_DETACH
		}
		if err := syscall.Unmount(mnt, flags); err != nil {
			if err == syscall.EBUSY {
				return fmt.Errorf("%s: busy (something still uses it; --lazy detaches it anyway)", mnt)
			}
			return fmt.Errorf("%s: %w", mnt, err)
		}
		return nil
	}
	args := []string{"-u"}
	if lazy {
		args = append(args, "-z")
	}
	tool := "fusermount3"
	if _, err := exec.LookPath(tool); err != nil {
		tool = "fusermount"
	}
	out, err := exec.Command(tool, append(args, mnt)...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %s", tool, out)
	}
	return nil
}
