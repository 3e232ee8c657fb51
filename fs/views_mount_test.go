package fs

import (
	"bytes"
	"encoding/binary"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/qcow2"
)

// mountForTest mounts this package's file system over src at a fresh
// folder, in the test's own process (as go-fuse's tests mount theirs), and
// unmounts it when the test ends. It needs root and /dev/fuse: without
// them the test is skipped, or fails under CI. (No mappings of the mount
// in such a test: a goroutine faulting on a page the same process serves
// can stop a garbage collection, and the server with it.)
func mountForTest(t *testing.T, cfg Config) string {
	t.Helper()
	fail := t.Skipf
	if os.Getenv("CI") == "true" {
		fail = t.Fatalf
	}
	if os.Geteuid() != 0 {
		fail("needs root")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		fail("needs /dev/fuse: %v", err)
	}
	cfg.Log = slog.New(slog.NewTextHandler(io.Discard, nil))
	root, err := NewRoot(cfg)
	if err != nil {
		t.Fatal(err)
	}
	root.m.inProcess = true
	mnt := t.TempDir()
	server, err := Mount(mnt, root, Options(cfg), nil)
	if err != nil {
		t.Fatal(err)
	}
	root.KernelFlags(server.KernelSettings().Flags64())
	t.Cleanup(func() {
		if err := server.Unmount(); err != nil {
			t.Errorf("unmount: %v", err)
		}
		root.Close()
	})
	return mnt
}

// TestViewsMounted: issue 43's scenario through a real mount of the file
// system, in process: an MBR with one partition at 1 MiB written through
// d.raw; a page of d.raw read into the kernel's cache; AAAA written
// through p1 and fsynced; BBBB written into the same page through d.raw
// and fsynced; then, with a descriptor of each file held open across the
// writes, AAAA written through p1 again and read through d.raw at once.
// Both files read both writes (the model), with and without the writeback
// cache.
func TestViewsMounted(t *testing.T) {
	for _, writeback := range []bool{true, false} {
		t.Run(map[bool]string{true: "writeback", false: "write-through"}[writeback], func(t *testing.T) {
			src := t.TempDir()
			if err := qcow2.Create(filepath.Join(src, "d.qcow2"), qcow2.CreateOptions{Size: 8 << 20}); err != nil {
				t.Fatal(err)
			}
			mnt := mountForTest(t, Config{Source: src, Writable: true, WritebackCache: writeback})
			raw := filepath.Join(mnt, "d.raw")
			p1 := filepath.Join(mnt, "d.raw.parts", "p1")
			model := make([]byte, 8<<20)
			write := func(path string, b []byte, off int64) {
				t.Helper()
				f, err := os.OpenFile(path, os.O_RDWR, 0)
				if err != nil {
					t.Fatal(err)
				}
				defer f.Close()
				if _, err := f.WriteAt(b, off); err != nil {
					t.Fatal(err)
				}
				if err := f.Sync(); err != nil {
					t.Fatal(err)
				}
			}
			// The MBR: one Linux partition, sectors 2048 to 6143.
			mbr := make([]byte, 512)
			entry := mbr[446:]
			entry[4] = 0x83
			binary.LittleEndian.PutUint32(entry[8:], 2048)
			binary.LittleEndian.PutUint32(entry[12:], 4096)
			mbr[510], mbr[511] = 0x55, 0xaa
			write(raw, mbr, 0)
			copy(model, mbr)

			const x = 1<<20 + 81920
			page := make([]byte, 4096)
			f, err := os.Open(raw)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := f.ReadAt(page, x); err != nil {
				t.Fatal(err)
			}
			f.Close()
			write(p1, []byte("AAAA"), 81920)
			copy(model[x:], "AAAA")
			write(raw, []byte("BBBB"), x+100)
			copy(model[x+100:], "BBBB")
			check := func(when string) {
				t.Helper()
				for _, v := range []struct {
					path  string
					start int64
					size  int64
				}{{raw, 0, 8 << 20}, {p1, 1 << 20, 2 << 20}} {
					got, err := os.ReadFile(v.path)
					if err != nil {
						t.Fatal(err)
					}
					if want := model[v.start:][:v.size]; !bytes.Equal(got, want) {
						i := 0
						for i < len(got) && i < len(want) && got[i] == want[i] {
							i++
						}
						t.Errorf("%s: %s differs from the model at byte %d", when, filepath.Base(v.path), i)
					}
				}
			}
			check("after the issue's writes")

			// Held open: raw first (with the page cache), p1 second
			// (without it, while raw is open for writing).
			fr, err := os.OpenFile(raw, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer fr.Close()
			fp, err := os.OpenFile(p1, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer fp.Close()
			if _, err := fr.ReadAt(page, x&^4095); err != nil {
				t.Fatal(err)
			}
			if _, err := fp.WriteAt([]byte("CCCC"), 81920+200); err != nil {
				t.Fatal(err)
			}
			copy(model[x+200:], "CCCC")
			if _, err := fr.ReadAt(page, x&^4095); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(page, model[x&^4095:][:4096]) {
				t.Error("a write through p1 is not seen by a read through d.raw right after it")
			}
			if _, err := fr.WriteAt([]byte("DDDD"), x+300); err != nil {
				t.Fatal(err)
			}
			copy(model[x+300:], "DDDD")
			if _, err := fp.ReadAt(page, 81920&^4095); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(page, model[x&^4095:][:4096]) {
				t.Error("a write through d.raw is not seen by a read through p1 right after it")
			}
			if err := unix.Fsync(int(fr.Fd())); err != nil {
				t.Fatal(err)
			}
			check("with both files open")
		})
	}
}
