package write

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// hostFS makes a small ext4 file system of size bytes, loop-mounted for the
// test, and returns its mount point.
func hostFS(t *testing.T, size string) string {
	t.Helper()
	qemu.Require(t, "mkfs.ext4", "mount", "umount")
	file := filepath.Join(t.TempDir(), "host.ext4")
	qemu.Run(t, "truncate", "-s", size, file)
	qemu.Run(t, "mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", file)
	dir := t.TempDir()
	qemu.Run(t, "mount", "-o", "loop", file, dir)
	t.Cleanup(func() {
		if out, err := exec.Command("umount", dir).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v %s", dir, err, out)
			exec.Command("umount", "-l", dir).Run()
		}
	})
	return dir
}

// freeBytes is what statfs says an unprivileged writer may still use.
func freeBytes(t *testing.T, dir string) int64 {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	return int64(st.Bavail) * st.Bsize
}

// leaveFree fills dir with a file so that about free bytes are left, and
// returns the file.
func leaveFree(t *testing.T, dir string, free int64) string {
	filler := filepath.Join(dir, "filler")
	if n := freeBytes(t, dir) - free; n > 0 {
		qemu.Run(t, "fallocate", "-l", strconv.FormatInt(n, 10), filler)
	}
	if got := freeBytes(t, dir); got < free-(1<<20) || got > free+(1<<20) {
		t.Fatalf("%d bytes free, want about %d", got, free)
	}
	return filler
}

// TestENOSPC: on a host file system with 1, 4 or 24 MiB free, the first
// 4 KiB write of a fresh image succeeds, as qemu-io's does on the same
// file system (the reservation ahead is a hint); writing on fails with
// ENOSPC, not EIO, once the host is full; after space is freed, writes go
// through again (the error did not stick); and after unmount the image
// keeps no space reserved past its clusters, qemu-img check finds it clean
// and every write acknowledged by fsync reads back.
func TestENOSPC(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "qemu-img", "qemu-io", "fallocate")
	for _, freeMiB := range []int64{1, 4, 24} {
		t.Run(fmt.Sprintf("%dMiB", freeMiB), func(t *testing.T) {
			host := hostFS(t, "96M")
			src := filepath.Join(host, "images")
			os.Mkdir(src, 0o755)
			img := filepath.Join(src, "fresh.qcow2")
			qemu.Create(t, "qcow2", img, "64M")
			peer := filepath.Join(host, "peer.qcow2")
			qemu.Create(t, "qcow2", peer, "64M")
			filler := leaveFree(t, host, freeMiB<<20)

			// qemu's own writer succeeds here.
			qemu.IO(t, peer, "write -P 0x33 0 4k")

			m := harness.Mount(t, src, "--writable")
			raw := filepath.Join(m.Dir, "fresh.raw")
			f, err := os.OpenFile(raw, os.O_RDWR|unix.O_DIRECT, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			buf := harness.AlignedBlock(t, 1<<20)
			model := make([]byte, 64<<20)
			write := func(off int64, n int, fill byte) error {
				for i := range buf[:n] {
					buf[i] = fill
				}
				if _, err := f.WriteAt(buf[:n], off); err != nil {
					return err
				}
				return f.Sync()
			}
			if err := write(0, 4096, 0x44); err != nil {
				t.Fatalf("the first 4 KiB write with %d MiB free: %v", freeMiB, err)
			}
			copy(model, buf[:4096])
			// Fill the host: 1 MiB writes until one fails; it must be
			// ENOSPC.
			var off int64 = 1 << 20
			var werr error
			for ; off < 64<<20; off += 1 << 20 {
				if werr = write(off, 1<<20, byte(off>>20)); werr != nil {
					break
				}
				copy(model[off:], buf[:1<<20])
			}
			if !errors.Is(werr, syscall.ENOSPC) {
				t.Fatalf("writing until the host is full: %v at %d, want ENOSPC", werr, off)
			}
			// Space comes back: so do writes.
			if err := os.Remove(filler); err != nil {
				t.Fatal(err)
			}
			if err := write(off, 1<<20, 0x77); err != nil {
				t.Fatalf("a write after space was freed: %v (the ENOSPC stuck)", err)
			}
			copy(model[off:], buf[:1<<20])
			f.Close()
			m.Unmount(t)

			qemu.Img(t, "check", img)
			out := string(qemu.Img(t, "check", "--output=json", img))
			var end int64
			if i := strings.Index(out, `"image-end-offset": `); i >= 0 {
				fmt.Sscan(out[i+len(`"image-end-offset": `):], &end)
			}
			st, err := os.Stat(img)
			if err != nil {
				t.Fatal(err)
			}
			if end == 0 || st.Size() > end {
				t.Errorf("after unmount the image file has %d bytes, its clusters end at %d: space is still reserved", st.Size(), end)
			}
			modelFile := filepath.Join(t.TempDir(), "model.raw")
			if err := os.WriteFile(modelFile, model, 0o644); err != nil {
				t.Fatal(err)
			}
			qemu.Img(t, "compare", "-f", "qcow2", "-F", "raw", img, modelFile)
		})
	}
}
