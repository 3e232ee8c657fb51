package write

// A disk's raw file and its partition files show the same bytes, and the
// kernel caches each in pages of its own (fs/views.go): these tests write
// through one and read through the others, with qemu as the last word.

import (
	"bytes"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// cacheModes are the two ways a writable mount writes: through the
// kernel's writeback cache (the default) and without it.
var cacheModes = []struct {
	name string
	args []string
}{
	{"writeback", []string{"--writable"}},
	{"write-through", []string{"--writable", "--no-writeback-cache"}},
}

// TestViewsIssue43 is issue 43's report, command for command: a page of
// d.raw read into the cache, AAAA written through its partition p1 (GPT, at
// 1 MiB) and fsynced, then BBBB written into the same page through d.raw
// and fsynced. qemu-img convert of the image after unmount must show both.
// Before the views were kept coherent, d.raw's cached page, read before
// AAAA, went back over it.
func TestViewsIssue43(t *testing.T) {
	qemu.Require(t, "sfdisk", "dd", "sh")
	const x = 1<<20 + 81920 // p1's byte 81920 in the disk
	work := t.TempDir()
	disk := filepath.Join(work, "d.img")
	if err := os.WriteFile(disk, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(disk, 80<<20); err != nil {
		t.Fatal(err)
	}
	harness.Partition(t, disk, "label: gpt\nstart=1MiB, size=64MiB, type=linux\n")
	for _, mode := range cacheModes {
		t.Run(mode.name, func(t *testing.T) {
			src := harness.SourceDir(t)
			img := filepath.Join(src, "d.qcow2")
			qemu.Img(t, "convert", "-q", "-f", "raw", "-O", "qcow2", disk, img)
			m := harness.Racy.Mount(t, src, mode.args...)
			script := fmt.Sprintf(`set -e
X=%d
dd if=d.raw bs=4k skip=$((X/4096)) count=1 status=none >/dev/null
printf AAAA | dd of=d.raw.parts/p1 bs=1 seek=81920 conv=notrunc,fsync status=none
printf BBBB | dd of=d.raw bs=1 seek=$((X+100)) conv=notrunc,fsync status=none
`, x)
			sh := exec.Command("sh", "-c", script)
			sh.Dir = m.Dir
			harness.WantOK(t, "the issue's commands", harness.RunCmd(t, sh))
			m.Unmount(t)
			qemu.CheckClean(t, img)
			want := make([]byte, 4096)
			copy(want[x%4096:], "AAAA")
			copy(want[x%4096+100:], "BBBB")
			got := qemu.RawBytes(t, img)[x/4096*4096:][:4096]
			if !bytes.Equal(got, want) {
				t.Errorf("qemu-img convert: the page of byte %d holds AAAA at %d: %v, BBBB at %d: %v (want both)",
					x, x%4096, bytes.Equal(got[x%4096:][:4], []byte("AAAA")), x%4096+100, bytes.Equal(got[x%4096+100:][:4], []byte("BBBB")))
			}
		})
	}
}

// TestViewsBackupAroundGuestEdit is the way issue 43 says a user meets the
// problem: copy the disk's raw file (a backup), loop-mount its partition,
// edit the guest's files, unmount, copy the raw file again. The second
// copy must be the disk as it is then (qemu-img convert after unmount),
// not old file-system metadata from the first copy's cached pages mixed
// with new data; its partition passes e2fsck and holds the new files.
func TestViewsBackupAroundGuestEdit(t *testing.T) {
	qemu.Require(t, "mkfs.ext4", "sfdisk", "losetup", "mount", "umount", "e2fsck", "cp")
	work := t.TempDir()
	tree := filepath.Join(work, "tree")
	want := harness.WriteGuestTree(t, tree)
	disk := harness.MakeGuestDisk(t, work, tree)
	for _, mode := range cacheModes {
		t.Run(mode.name, func(t *testing.T) {
			src := harness.SourceDir(t)
			img := filepath.Join(src, "vm.qcow2")
			qemu.Img(t, "convert", "-q", "-f", "raw", "-O", "qcow2", disk, img)
			m := harness.Racy.Mount(t, src, mode.args...)
			raw := filepath.Join(m.Dir, "vm.raw")
			out := t.TempDir()
			qemu.Run(t, "cp", raw, filepath.Join(out, "first.raw"))

			dev, detach := harness.AttachLoop(t, filepath.Join(m.Dir, "vm.raw.parts", "p1"))
			guest, unmount := harness.MountGuest(t, dev, "")
			edited := writeFiles(t, guest, 40, 43)
			if err := os.RemoveAll(filepath.Join(guest, "data")); err != nil {
				t.Fatal(err)
			}
			unmount()
			detach()

			second := filepath.Join(out, "second.raw")
			qemu.Run(t, "cp", raw, second)
			m.Unmount(t)
			qemu.CheckClean(t, img)
			b, err := os.ReadFile(second)
			if err != nil {
				t.Fatal(err)
			}
			if i := harness.FirstDiff(b, qemu.RawBytes(t, img)); i >= 0 {
				t.Errorf("the copy made after the guest's edit differs from qemu-img convert of the image at byte %d", i)
			}

			// The copy's guest file system (the partition MakeGuestDisk
			// makes: 64 MiB at 1 MiB), as the kernel reads it.
			exp := maps.Clone(want)
			for name := range exp {
				if name == "data" || strings.HasPrefix(name, "data/") {
					delete(exp, name)
				}
			}
			maps.Copy(exp, edited)
			cdev, _ := harness.AttachLoop(t, second, "-r", "-o", strconv.Itoa(1<<20), "--sizelimit", strconv.Itoa(64<<20))
			harness.Fsck(t, cdev)
			cdir, _ := harness.MountGuest(t, cdev, "ro,noload")
			harness.CompareTrees(t, harness.ReadTree(t, cdir), exp)
		})
	}
}
