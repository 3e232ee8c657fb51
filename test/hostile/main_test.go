// Package hostile tests hostile images and sources: fields at their
// limits, huge tables, corrupt and oversized compressed clusters, stuck
// disks, swapped folders; the daemon's time, memory and descriptors stay
// bounded.
package hostile

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/test/harness"
)

func TestMain(m *testing.M) {
	if h := os.Getenv(helperEnv); h != "" {
		os.Exit(runHelper(h))
	}
	harness.Main(m)
}

// helperEnv makes the test binary a helper process (TestMain): a caller
// that the test can kill in the middle of a request.
const helperEnv = "QCOWFS_TEST_HELPER"

// runHelper runs the helper named by h: "seek-data:PATH" asks
// lseek(SEEK_DATA) from 0 of PATH.
func runHelper(h string) int {
	if path, ok := strings.CutPrefix(h, "seek-data:"); ok {
		fd, err := unix.Open(path, unix.O_RDONLY, 0)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Println("open")
		off, err := unix.Seek(fd, 0, unix.SEEK_DATA)
		fmt.Println(off, err)
		return 0
	}
	return 2
}
