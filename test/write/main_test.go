// Package write tests writable mounts: writes as qemu-io makes them, the
// writeback cache, overlays, guest file systems written through loop
// devices, ENOSPC, torn sectors, a daemon killed mid-write, persistent
// bitmaps kept true through all of it, encrypted images (written as qemu
// writes them, their overlays, named and throwaway, LUKS-encrypted).
package write

import (
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
