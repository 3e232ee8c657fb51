package test

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/test/qemu"
)

// A writable mount has the kernel's writeback cache unless
// --no-writeback-cache: these tests pin down what differs between the two.

// TestWriteBeyondTheEnd: a write that runs past the end of the disk. With
// --no-writeback-cache it is cut at the end, as a disk cuts it, and one
// that starts at the end fails with ENOSPC. With the writeback cache (the
// default) the kernel takes the whole write into its page cache, and the
// failure comes at fsync: ENOSPC. Either way what falls inside the disk is
// written, and the disk keeps its size.
func TestWriteBeyondTheEnd(t *testing.T) {
	requireFUSE(t)
	const size = 4 << 20
	for _, mode := range []string{"writeback", "write-through"} {
		t.Run(mode, func(t *testing.T) {
			src := qemu.TempDir(t)
			img := filepath.Join(src, "end.qcow2")
			qemu.Create(t, "qcow2", img, "4M")
			args := []string{"--writable", racyMount}
			if mode == "write-through" {
				args = append(args, "--no-writeback-cache")
			}
			m := mountImages(t, src, args...)
			logMount = m
			f, err := os.OpenFile(filepath.Join(m.Dir, "end.raw"), os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			data := bytes.Repeat([]byte("end!"), 2048) // 8 KiB
			n, err := unix.Pwrite(int(f.Fd()), data, size-4096)
			switch mode {
			case "writeback":
				if err != nil || n != len(data) {
					t.Fatalf("write of 8 KiB over the end: %d, %v; want it taken whole (the page cache)", n, err)
				}
				if err := f.Sync(); !errors.Is(err, syscall.ENOSPC) {
					t.Fatalf("fsync after a write past the end: %v, want ENOSPC", err)
				}
			case "write-through":
				if err != nil || n != 4096 {
					t.Fatalf("write of 8 KiB over the end: %d, %v; want it cut at the end (4096)", n, err)
				}
				if _, err := unix.Pwrite(int(f.Fd()), data, size); !errors.Is(err, syscall.ENOSPC) {
					t.Fatalf("write at the end: %v, want ENOSPC", err)
				}
				if err := f.Sync(); err != nil {
					t.Fatalf("fsync: %v", err)
				}
			}
			f.Close()
			m.unmount(t)
			qemuCheckClean(t, img)
			if got := int64(qemu.Info(t, img)["virtual-size"].(float64)); got != size {
				t.Errorf("virtual size %d after the write, want %d", got, size)
			}
			raw, err := os.ReadFile(qemu.ToRaw(t, img, filepath.Join(t.TempDir(), "end.raw")))
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(raw[size-4096:], data[:4096]) || strings.Trim(string(raw[:size-4096]), "\x00") != "" {
				t.Errorf("the disk does not hold the part of the write inside it, and only that")
			}
		})
	}
}

// TestDirectAfterBuffered: with the writeback cache, a buffered writer
// leaves dirty pages over a range, then four O_DIRECT writers (whose writes
// the kernel sends in parallel, fs/image.go) overwrite parts of it. The
// direct writes must win: the kernel writes the range's dirty pages back
// before each direct write (FUSE_DIRECT_IO_ALLOW_MMAP, fs/root.go), so no
// dirty page lands after one. The buffered writer then writes again over
// other parts and fsyncs. After unmount qemu-img convert equals the model.
func TestDirectAfterBuffered(t *testing.T) {
	requireFUSE(t)
	src := qemu.TempDir(t)
	const size = 16 << 20
	img := filepath.Join(src, "mix.qcow2")
	qemu.Create(t, "qcow2", img, "16M")
	m := mountImages(t, src, "--writable", racyMount)
	logMount = m
	file := filepath.Join(m.Dir, "mix.raw")
	buffered, err := os.OpenFile(file, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer buffered.Close()
	model := make([]byte, size)
	fill := func(b []byte, off int64, tag byte) {
		for i := range b {
			b[i] = byte((off+int64(i))/512) ^ tag
		}
	}
	all := make([]byte, size)
	fill(all, 0, 0xa5)
	if _, err := buffered.WriteAt(all, 0); err != nil {
		t.Fatal(err)
	}
	copy(model, all)

	const writers = 4
	directWriters(t, file, writers, func(w int, f *os.File, buf []byte) error {
		quarter := int64(size / writers)
		for i := range 32 {
			// Every other 64 KiB block of the writer's quarter.
			off := int64(w)*quarter + int64(i)*2*(64<<10)
			if off+64<<10 > int64(w+1)*quarter {
				break
			}
			fill(buf, off, byte(0x10+w))
			if _, err := f.WriteAt(buf, off); err != nil {
				return fmt.Errorf("writer %d: write at %d: %w", w, off, err)
			}
			copy(model[off:], buf) // each writer has its own quarter
		}
		return nil
	})
	// The buffered writer again, over the blocks the direct writers left.
	part := make([]byte, 64<<10)
	for off := int64(64 << 10); off < size; off += 4 * (64 << 10) {
		fill(part, off, 0x3c)
		if _, err := buffered.WriteAt(part, off); err != nil {
			t.Fatal(err)
		}
		copy(model[off:], part)
	}
	if err := buffered.Sync(); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, size)
	if _, err := buffered.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if i := firstDiff(got, model); i >= 0 {
		t.Fatalf("the mount reads differently from the model at byte %d", i)
	}
	buffered.Close()
	m.unmount(t)
	qemuCheckClean(t, img)
	after, err := os.ReadFile(qemu.ToRaw(t, img, filepath.Join(t.TempDir(), "mix.raw")))
	if err != nil {
		t.Fatal(err)
	}
	if i := firstDiff(after, model); i >= 0 {
		t.Fatalf("qemu-img convert differs from the model at byte %d (%#x, want %#x): a dirty page written back over a direct write?", i, after[i], model[i])
	}
}
