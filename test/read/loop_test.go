package read

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestLoopMountGuestPartition is what a user does with an exposed raw file:
// attach it to a loop device, find the partition in it and mount the guest
// file system. The kernel, not qemu, reads the disk here: page-sized reads
// through the loop driver, ext4's own readahead, the GPT read by partx or
// the kernel. The files read back must be the files put in, byte for byte.
func TestLoopMountGuestPartition(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "sfdisk", "mkfs.ext4", "losetup", "partx", "mount")

	work := qemu.TempDir(t)
	want := harness.WriteGuestTree(t, filepath.Join(work, "tree"))
	disk := harness.MakeGuestDisk(t, work, filepath.Join(work, "tree"))

	for _, v := range []struct {
		name string
		opts []string // for qemu-img convert
	}{
		{"plain", nil},
		// Random data does not compress, so this image mixes
		// compressed clusters (text, ext4 metadata) with clusters qemu
		// stored uncompressed.
		{"compressed", []string{"-c"}},
	} {
		t.Run(v.name, func(t *testing.T) {
			src := qemu.TempDir(t)
			args := append(append([]string{"convert", "-q", "-f", "raw", "-O", "qcow2"}, v.opts...),
				disk, filepath.Join(src, "disk.qcow2"))
			qemu.Img(t, args...)

			// Each step registers its own undoing as soon as there
			// is something to undo; Cleanup runs them last first,
			// so the guest is unmounted, then the partitions and
			// the loop device go, then the harness unmounts qcowfs.
			m := harness.Mount(t, src)
			dev, _ := harness.AttachLoop(t, filepath.Join(m.Dir, "disk.raw"), "-r", "-P")
			part := harness.PartitionNode(t, dev)
			guest, _ := harness.MountGuest(t, part, "ro,noload")

			got := harness.ReadTree(t, guest)
			harness.CompareTrees(t, got, want)
			if log := m.LogText(t); strings.Contains(log, "level=ERROR") {
				t.Errorf("the daemon logged errors:\n%s", log)
			}
		})
	}
}
