package main

import (
	"os"
	"syscall"
)

// testHook returns the hook the end-to-end tests crash the daemon with:
// QCOWFS_TEST_KILL_AT=POINT makes the daemon kill itself (SIGKILL, as a
// crash or kill -9 would) when its work reaches POINT (fs.Config.TestHook
// names the points). Unset, there is no hook.
func testHook() func(string) {
	at := os.Getenv("QCOWFS_TEST_KILL_AT")
	if at == "" {
		return nil
	}
	return func(point string) {
		if point == at {
			syscall.Kill(os.Getpid(), syscall.SIGKILL)
		}
	}
}
