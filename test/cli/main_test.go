// Package cli tests the command line end to end: mount and unmount, the
// daemon and signals, status, the mount-helper convention (mount -t,
// fstab), flags, -o options, errors and help; info, map and check against
// qemu-img.
package cli

import (
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
