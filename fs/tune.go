package fs

import (
	"fmt"
	"os"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
)

// SetReadAhead sets the kernel's readahead for the FUSE mount at
// mountpoint to kb KiB. The kernel caps a FUSE connection's readahead at
// its default (128 KiB) whatever the daemon asks for at init, so a larger
// window has to be set on the connection's backing device afterwards:
// /sys/class/bdi/MAJOR:MINOR/read_ahead_kb. Sequential reads then reach
// the daemon as requests of up to max_read (1 MiB), several in flight.
// Writing there needs root.
func SetReadAhead(mountpoint string, kb int) error {
	var st syscall.Stat_t
	if err := syscall.Stat(mountpoint, &st); err != nil {
		return err
	}
	dev := uint64(st.Dev)
	path := fmt.Sprintf("/sys/class/bdi/%d:%d/read_ahead_kb", unix.Major(dev), unix.Minor(dev))
	if err := os.WriteFile(path, []byte(strconv.Itoa(kb)), 0); err != nil {
		return fmt.Errorf("setting readahead: %w", err)
	}
	return nil
}
