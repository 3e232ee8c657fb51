package test

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

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
	sfdisk := exec.Command("sfdisk", "-q", disk)
	sfdisk.Stdin = strings.NewReader(fmt.Sprintf("label: gpt\nstart=1MiB, size=1MiB, type=linux\nstart=2MiB, size=%dKiB, type=linux\n", partSize>>10))
	if out, err := sfdisk.CombinedOutput(); err != nil {
		t.Fatalf("sfdisk: %v\n%s", err, out)
	}
	return disk
}

// attachLoopRW attaches file to a loop device for reading and writing and
// detaches it when the test ends (or when the returned func is called).
func attachLoopRW(t *testing.T, file string) (string, func()) {
	t.Helper()
	dev := strings.TrimSpace(string(qemu.Run(t, "losetup", "-f", "--show", file)))
	done := false
	detach := func() {
		if !done {
			done = true
			if out, err := exec.Command("losetup", "-d", dev).CombinedOutput(); err != nil {
				t.Errorf("losetup -d %s: %v %s", dev, err, out)
			}
		}
	}
	t.Cleanup(detach)
	return dev, detach
}

// mountRW mounts the ext4 on dev read-write and unmounts it when the test
// ends (or when the returned func is called).
func mountRW(t *testing.T, dev string) (string, func()) {
	t.Helper()
	dir := t.TempDir()
	qemu.Run(t, "mount", "-t", "ext4", dev, dir)
	done := false
	unmount := func() {
		if !done {
			done = true
			if out, err := exec.Command("umount", dir).CombinedOutput(); err != nil {
				t.Errorf("umount %s: %v %s", dir, err, out)
				exec.Command("umount", "-l", dir).Run()
			}
		}
	}
	t.Cleanup(unmount)
	return dir, unmount
}

// writeFiles writes n seeded files into dir and returns their sha256 by
// relative path.
func writeFiles(t *testing.T, dir string, n int, seed uint64) map[string]string {
	t.Helper()
	r := rand.New(rand.NewPCG(seed, 3))
	sums := map[string]string{}
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
		sums[name] = hex.EncodeToString(s[:])
	}
	return sums
}

// TestGuestFilesystemWritable: a GPT disk's second partition file
// (vm.raw.parts/p2), loop-mounted read-write from a writable mount: mkfs,
// a few hundred files written, half of them deleted, fstrim; then
// e2fsck -fn finds it clean, qemu-img check finds the image clean, the
// image file takes less space than before fstrim, and a fresh read-only
// mount reads every remaining file back with its sha256. Also mkfs.ext4
// straight on an empty image's raw file.
func TestGuestFilesystemWritable(t *testing.T) {
	requireFUSE(t)
	qemu.Require(t, "sfdisk", "mkfs.ext4", "e2fsck", "losetup", "fstrim", "mount")
	work := t.TempDir()
	src := qemu.TempDir(t)
	const partSize = 96 << 20
	disk := makeTwoPartDisk(t, work, partSize)
	img := filepath.Join(src, "vm.qcow2")
	qemu.Img(t, "convert", "-q", "-f", "raw", "-O", "qcow2", disk, img)
	qemu.Create(t, "qcow2", filepath.Join(src, "blank.qcow2"), "64M")

	m := mountImages(t, src, "--writable")
	p2 := filepath.Join(m.Dir, "vm.raw.parts", "p2")
	if st, err := os.Stat(p2); err != nil || st.Size() != partSize || st.Mode().Perm()&0o200 == 0 {
		t.Fatalf("p2: %v, %v; want a writable file of %d bytes", st, err, partSize)
	}
	qemu.Run(t, "mkfs.ext4", "-q", "-F", "-E", "nodiscard", p2)
	dev, detach := attachLoopRW(t, p2)
	dir, umount := mountRW(t, dev)
	sums := writeFiles(t, dir, 400, 1)
	qemu.Run(t, "sync", "-f", dir)
	// Delete every other file: space for fstrim to give back.
	for name := range sums {
		if strings.HasSuffix(strings.TrimSuffix(name, ".bin"), "0") || strings.HasSuffix(strings.TrimSuffix(name, ".bin"), "2") ||
			strings.HasSuffix(strings.TrimSuffix(name, ".bin"), "4") || strings.HasSuffix(strings.TrimSuffix(name, ".bin"), "6") ||
			strings.HasSuffix(strings.TrimSuffix(name, ".bin"), "8") {
			if err := os.Remove(filepath.Join(dir, name)); err != nil {
				t.Fatal(err)
			}
			delete(sums, name)
		}
	}
	qemu.Run(t, "sync", "-f", dir)
	usedBefore := allocated(t, img)
	qemu.Run(t, "fstrim", dir)
	umount()
	detach()
	// e2fsck reads the partition file of the live mount (read-only).
	if out, err := exec.Command("e2fsck", "-fn", p2).CombinedOutput(); err != nil {
		t.Errorf("e2fsck -fn %s: %v\n%s", p2, err, out)
	}

	// mkfs.ext4 on a whole raw file.
	blank := filepath.Join(m.Dir, "blank.raw")
	qemu.Run(t, "mkfs.ext4", "-q", "-F", blank)
	if out, err := exec.Command("e2fsck", "-fn", blank).CombinedOutput(); err != nil {
		t.Errorf("e2fsck -fn %s: %v\n%s", blank, err, out)
	}
	m.unmount(t)

	qemuCheckClean(t, img)
	qemuCheckClean(t, filepath.Join(src, "blank.qcow2"))
	if usedAfter := allocated(t, img); usedAfter >= usedBefore {
		t.Errorf("the image takes %d bytes after fstrim, %d before: fstrim gave nothing back", usedAfter, usedBefore)
	} else {
		t.Logf("fstrim: the image file went from %d to %d bytes allocated", usedBefore, usedAfter)
	}

	// A fresh read-only mount reads the files back.
	ro := mountImages(t, src)
	rdev := attachLoop2(t, filepath.Join(ro.Dir, "vm.raw.parts", "p2"))
	rdir := mountGuest(t, rdev)
	got := map[string]string{}
	filepath.WalkDir(rdir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || strings.HasPrefix(d.Name(), "lost+found") {
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			t.Error(err)
			return nil
		}
		rel, _ := filepath.Rel(rdir, p)
		s := sha256.Sum256(b)
		got[filepath.ToSlash(rel)] = hex.EncodeToString(s[:])
		return nil
	})
	if len(got) != len(sums) {
		t.Errorf("read back %d files, wrote %d", len(got), len(sums))
	}
	for name, want := range sums {
		if got[name] != want {
			t.Errorf("%s: sha256 %s, wrote %s", name, got[name], want)
		}
	}
}

// attachLoop2 attaches a file read-only to a loop device (no partition
// scan) and detaches it when the test ends.
func attachLoop2(t *testing.T, file string) string {
	t.Helper()
	dev := strings.TrimSpace(string(qemu.Run(t, "losetup", "-r", "-f", "--show", file)))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
	return dev
}

// TestFioVerify: fio's random writes of 4 KiB, 64 KiB and 1 MiB blocks with
// crc32c verification, four jobs, O_DIRECT, on an empty image and on a
// fully allocated one, through a writable mount; the 1 MiB blocks are each
// read back right after they are written. Verification passes and
// qemu-img check finds the images clean.
func TestFioVerify(t *testing.T) {
	requireFUSE(t)
	qemu.Require(t, "fio")
	src := qemu.TempDir(t)
	qemu.Create(t, "qcow2", filepath.Join(src, "empty.qcow2"), "256M")
	full := filepath.Join(src, "full.qcow2")
	qemu.Create(t, "qcow2", full, "256M")
	qemu.IO(t, full, "write -P 0x5a 0 256M")
	m := mountImages(t, src, "--writable", racyMount)
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
	m.unmount(t)
	qemuCheckClean(t, filepath.Join(src, "empty.qcow2"))
	qemuCheckClean(t, full)
}
