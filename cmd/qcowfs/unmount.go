package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"

	"github.com/qcowfs/qcowfs/internal/mountinfo"
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
	mnt, err := filepath.Abs(c.Mountpoint)
	if err != nil {
		return err
	}
	if real, err := filepath.EvalSymlinks(mnt); err == nil {
		mnt = real
	}
	m, err := mountinfo.At(mnt)
	if err != nil {
		return err
	}
	if m == nil {
		return fmt.Errorf("%s: not mounted", c.Mountpoint)
	}
	if m.FSType != "fuse.qcowfs" {
		return fmt.Errorf("%s: a %s mount, not a qcowfs one", c.Mountpoint, m.FSType)
	}
	return unmount(mnt, c.Lazy)
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
