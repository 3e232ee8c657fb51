// Package read tests reading through a mount: bytes as qemu-img convert
// makes them, holes and lseek, the tree of files, snapshots, partitions,
// changed-blocks views of bitmaps, loop-mounted guests, images changed
// between opens.
package read

import (
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
