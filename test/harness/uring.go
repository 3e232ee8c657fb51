package harness

import (
	"fmt"
	"os"
	"strings"
)

// The transport the tests' mounts use: QCOWFS_TEST_IO_URING=on mounts
// every test's daemon with --io-uring=on (make test runs the end-to-end
// packages once over /dev/fuse and once over the ring), off or auto
// likewise; unset, qcowfs's default. A test that passes --io-uring itself
// wins (the flag given last does).
const uringEnv = "QCOWFS_TEST_IO_URING"

// uringParam is the kernel's switch for FUSE over io_uring.
const uringParam = "/sys/module/fuse/parameters/enable_uring"

func transportFlags() []string {
	if v := os.Getenv(uringEnv); v != "" {
		return []string{"--io-uring=" + v}
	}
	return nil
}

// OverRing reports whether the tests' mounts are asked to use the ring.
func OverRing() bool { return os.Getenv(uringEnv) == "on" }

// setUringParam switches the kernel's FUSE over io_uring on for a run with
// QCOWFS_TEST_IO_URING=on, and returns what puts it back as it was.
// qcowfs never flips it itself; the tests, as root, do.
func setUringParam() (restore func(), err error) {
	if !OverRing() {
		return func() {}, nil
	}
	prev, err := os.ReadFile(uringParam)
	if err != nil {
		return nil, fmt.Errorf("%s=on: %w (the kernel lacks FUSE over io_uring: Linux 6.14 or later, CONFIG_FUSE_IO_URING)", uringEnv, err)
	}
	if err := os.WriteFile(uringParam, []byte("Y"), 0); err != nil {
		return nil, fmt.Errorf("%s=on: switching FUSE over io_uring on: %w", uringEnv, err)
	}
	return func() { os.WriteFile(uringParam, []byte(strings.TrimSpace(string(prev))), 0) }, nil
}
