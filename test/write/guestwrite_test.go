package write

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// allocated is the space the host file system gives a file.
func allocated(t *testing.T, path string) int64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

// makeTwoPartDisk makes a raw GPT disk with a small first partition and an
// empty second one of partSize bytes at 2 MiB, and returns it.
func makeTwoPartDisk(t *testing.T, dir string, partSize int64) string {
	t.Helper()
	disk := filepath.Join(dir, "disk.img")
	f, err := os.Create(disk)
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(2<<20 + partSize + 1<<20)
	f.Close()
	harness.Partition(t, disk, fmt.Sprintf("label: gpt\nstart=1MiB, size=1MiB, type=linux\nstart=2MiB, size=%dKiB, type=linux\n", partSize>>10))
	return disk
}

// writeFiles writes n seeded files into dir (in 17 folders) and returns
// what it wrote, as harness.ReadTree will find it.
func writeFiles(t *testing.T, dir string, n int, seed uint64) map[string]harness.TreeEntry {
	t.Helper()
	r := rand.New(rand.NewPCG(seed, 3))
	tree := map[string]harness.TreeEntry{}
	for i := 0; i < n; i++ {
		name := fmt.Sprintf("d%02d/f%03d.bin", i%17, i)
		b := make([]byte, r.IntN(64<<10))
		for j := range b {
			b[j] = byte(r.IntN(256))
		}
		os.MkdirAll(filepath.Join(dir, filepath.Dir(name)), 0o755)
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
		s := sha256.Sum256(b)
		tree[filepath.Dir(name)] = harness.TreeEntry{Dir: true}
		tree[name] = harness.TreeEntry{Size: int64(len(b)), Sum: hex.EncodeToString(s[:])}
	}
	return tree
}

// TestGuestFilesystemWritable: a GPT disk's second partition file
// (vm.raw.parts/p2), loop-mounted read-write from a writable mount: mkfs,
// a few hundred files written, half of them deleted, fstrim; then
// e2fsck -fn finds it clean, qemu-img check finds the image clean, the
// image file takes less space than before fstrim, and a fresh read-only
// mount reads every remaining file back with its sha256. Also mkfs.ext4
// straight on an empty image's raw file.
func TestGuestFilesystemWritable(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "sfdisk", "mkfs.ext4", "e2fsck", "losetup", "fstrim", "mount")
	work := t.TempDir()
	src := qemu.TempDir(t)
	const partSize = 96 << 20
	disk := makeTwoPartDisk(t, work, partSize)
	img := filepath.Join(src, "vm.qcow2")
	qemu.Img(t, "convert", "-q", "-f", "raw", "-O", "qcow2", disk, img)
	qemu.Create(t, "qcow2", filepath.Join(src, "blank.qcow2"), "64M")

	m := harness.Mount(t, src, "--writable")
	p2 := filepath.Join(m.Dir, "vm.raw.parts", "p2")
	if st, err := os.Stat(p2); err != nil || st.Size() != partSize || st.Mode().Perm()&0o200 == 0 {
		t.Fatalf("p2: %v, %v; want a writable file of %d bytes", st, err, partSize)
	}
	qemu.Run(t, "mkfs.ext4", "-q", "-F", "-E", "nodiscard", p2)
	dev, detach := harness.AttachLoop(t, p2)
	dir, umount := harness.MountGuest(t, dev, "")
	want := writeFiles(t, dir, 400, 1)
	qemu.Run(t, "sync", "-f", dir)
	// Delete every other file: space for fstrim to give back.
	for name, e := range want {
		if e.Dir {
			continue
		}
		if strings.HasSuffix(strings.TrimSuffix(name, ".bin"), "0") || strings.HasSuffix(strings.TrimSuffix(name, ".bin"), "2") ||
			strings.HasSuffix(strings.TrimSuffix(name, ".bin"), "4") || strings.HasSuffix(strings.TrimSuffix(name, ".bin"), "6") ||
			strings.HasSuffix(strings.TrimSuffix(name, ".bin"), "8") {
			if err := os.Remove(filepath.Join(dir, name)); err != nil {
				t.Fatal(err)
			}
			delete(want, name)
		}
	}
	qemu.Run(t, "sync", "-f", dir)
	usedBefore := allocated(t, img)
	qemu.Run(t, "fstrim", dir)
	umount()
	detach()
	// e2fsck reads the partition file of the live mount (read-only).
	harness.Fsck(t, p2)

	// mkfs.ext4 on a whole raw file.
	blank := filepath.Join(m.Dir, "blank.raw")
	qemu.Run(t, "mkfs.ext4", "-q", "-F", blank)
	harness.Fsck(t, blank)
	m.Unmount(t)

	qemu.CheckClean(t, img)
	qemu.CheckClean(t, filepath.Join(src, "blank.qcow2"))
	if usedAfter := allocated(t, img); usedAfter >= usedBefore {
		t.Errorf("the image takes %d bytes after fstrim, %d before: fstrim gave nothing back", usedAfter, usedBefore)
	} else {
		t.Logf("fstrim: the image file went from %d to %d bytes allocated", usedBefore, usedAfter)
	}

	// A fresh read-only mount reads the files back.
	ro := harness.Mount(t, src)
	rdev, _ := harness.AttachLoop(t, filepath.Join(ro.Dir, "vm.raw.parts", "p2"), "-r")
	rdir, _ := harness.MountGuest(t, rdev, "ro,noload")
	harness.CompareTrees(t, harness.ReadTree(t, rdir), want)
}

// TestFioVerify: fio's random writes of 4 KiB, 64 KiB and 1 MiB blocks with
// crc32c verification, four jobs, O_DIRECT, on an empty image and on a
// fully allocated one, through a writable mount; the 1 MiB blocks are each
// read back right after they are written. Verification passes and
// qemu-img check finds the images clean.
func TestFioVerify(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "fio")
	src := qemu.TempDir(t)
	qemu.Create(t, "qcow2", filepath.Join(src, "empty.qcow2"), "256M")
	full := qemu.Make(t, filepath.Join(src, "full.qcow2"), "256M", "write -P 0x5a 0 256M")
	m := harness.Racy.Mount(t, src, "--writable")
	for _, image := range []string{"empty", "full"} {
		for _, bs := range []string{"4k", "64k", "1m"} {
			t.Run(image+"-"+bs, func(t *testing.T) {
				args := []string{"--name=verify", "--filename=" + filepath.Join(m.Dir, image+".raw"),
					"--rw=randwrite", "--bs=" + bs, "--direct=1", "--ioengine=psync", "--numjobs=4",
					"--size=48M", "--offset_increment=64M", "--verify=crc32c", "--do_verify=1",
					"--verify_fatal=1", "--group_reporting", "--randseed=7"}
				if bs == "1m" {
					// Each block read back as soon as it is written:
					// its host write is still in flight (qcow2/behind.go).
					args = append(args, "--verify_backlog=1")
				}
				cmd := exec.Command("fio", args...)
				start := time.Now()
				out, err := cmd.CombinedOutput()
				if err != nil || strings.Contains(string(out), "verify:") && strings.Contains(string(out), "bad") {
					t.Fatalf("fio: %v\n%s", err, out)
				}
				t.Logf("fio %s %s: %v", image, bs, time.Since(start).Round(time.Millisecond))
			})
		}
	}
	m.Unmount(t)
	qemu.CheckClean(t, filepath.Join(src, "empty.qcow2"))
	qemu.CheckClean(t, full)
}
