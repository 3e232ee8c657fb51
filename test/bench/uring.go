package main

import (
	"fmt"
	"os"
	"strings"
)

// uringParam is the kernel's switch for FUSE over io_uring, which qcowfs
// uses by default (--io-uring=auto) where it is on.
const uringParam = "/sys/module/fuse/parameters/enable_uring"

// uringOn switches FUSE over io_uring on for the run, so that "qcowfs"
// (auto) serves over the rings and "qcowfs --io-uring=off" over
// /dev/fuse, and returns what puts the switch back as it was. On a kernel
// without it both serve over /dev/fuse, which the report's machine line
// says.
func uringOn() (restore func(), state string) {
	prev, err := os.ReadFile(uringParam)
	if err != nil {
		return func() {}, "FUSE over io_uring: not in this kernel (qcowfs serves over /dev/fuse)"
	}
	if err := os.WriteFile(uringParam, []byte("Y"), 0); err != nil {
		return func() {}, fmt.Sprintf("FUSE over io_uring: cannot switch it on: %v", err)
	}
	return func() { os.WriteFile(uringParam, []byte(strings.TrimSpace(string(prev))), 0) },
		"FUSE over io_uring: on for the run (qcowfs's default, --io-uring=auto, uses it)"
}
