// Package lock tests how mounts share images with qemu and with each
// other by qemu's locks.
package lock

import (
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
