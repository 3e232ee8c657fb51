package write

// A writable mount has the kernel's writeback cache unless
// --no-writeback-cache: these tests pin down what differs between the
// two, and what O_DIRECT writers in parallel leave to a buffered reader
// and a shared mapping.

import (
	"bytes"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestWriteAcrossTheEnd: a write that crosses the end of a disk file or a
// partition file, after writes inside the file in the same pages (and in
// the page before, so that the kernel may send them in one piece). A disk
// takes what fits and fails the rest with ENOSPC, and so does the mount:
//
//   - --no-writeback-cache: the write returns the bytes that fit (a short
//     count, as at the end of a block device) and the next one ENOSPC; dd,
//     which writes the rest again, fails with ENOSPC.
//   - the writeback cache (the default): the kernel takes the whole write
//     into its page cache, so write(2) returns it all; writing it back fails
//     with ENOSPC, which fsync (or, without one, close) returns. So it does
//     when an O_DIRECT handle of the file is open too (the kernel may write
//     back through that handle). The kernel grew the size it keeps for the
//     open file (fstat, not checked), but stat of the name right after the
//     fsync shows the disk's size (a new inode, fs/writeback.go).
//
// Either way the file keeps its size: stat right after the writer closed,
// and after the kernel's caches are dropped, shows the size it had, and a
// read at the end finds nothing. After unmount, qemu-img check finds the
// image clean, its virtual size unchanged, and qemu-img convert equals the
// model: every byte written inside the file is there, none past its end.
func TestWriteAcrossTheEnd(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "sfdisk", "dd")
	const (
		diskSize  = 48 << 20
		partStart = 1 << 20
		partSize  = 65535 * 512 // the partition ends inside a page
	)
	// One guest disk for every case: an MBR with one partition.
	work := t.TempDir()
	template := filepath.Join(work, "disk.img")
	if err := os.WriteFile(template, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(template, diskSize); err != nil {
		t.Fatal(err)
	}
	harness.Partition(t, template, fmt.Sprintf("label: dos\nstart=%d, size=%d, type=83\n", partStart/512, partSize/512))
	blank, err := os.ReadFile(template)
	if err != nil {
		t.Fatal(err)
	}
	fill := func(n int, tag byte) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = tag + byte(i%251)
		}
		return b
	}
	for _, mode := range []string{"writeback", "write-through"} {
		t.Run(mode, func(t *testing.T) {
			src := qemu.TempDir(t)
			type target struct{ name, image, file string }
			var cases []target
			for _, part := range []bool{false, true} {
				for _, how := range []string{"pwrite", "write", "dd", "direct-beside"} {
					name := "disk-" + how
					file := name + ".raw"
					if part {
						name = "part-" + how
						file = filepath.Join(name+".raw.parts", "p1")
					}
					img := filepath.Join(src, name+".qcow2")
					qemu.Img(t, "convert", "-q", "-f", "raw", "-O", "qcow2", template, img)
					cases = append(cases, target{name, img, file})
				}
			}
			args := []string{"--writable"}
			if mode == "write-through" {
				args = append(args, "--no-writeback-cache")
			}
			m := harness.Racy.Mount(t, src, args...)
			models := map[string][]byte{}
			for _, c := range cases {
				t.Run(c.name, func(t *testing.T) {
					path := filepath.Join(m.Dir, c.file)
					how := strings.SplitN(c.name, "-", 2)[1]
					start, size := int64(0), int64(diskSize)
					if strings.HasPrefix(c.name, "part-") {
						start, size = partStart, partSize
					}
					model := slices.Clone(blank)
					wantSize := func(when string) {
						t.Helper()
						if st, err := os.Stat(path); err != nil {
							t.Errorf("stat %s: %v", when, err)
						} else if st.Size() != size {
							t.Errorf("stat %s: size %d, want %d", when, st.Size(), size)
						}
					}
					f := harness.OpenFile(t, path, os.O_RDWR)
					direct := f // a second handle, or f again
					if how == "direct-beside" {
						// Opened last, the O_DIRECT handle is the
						// one the kernel writes cached pages back
						// through.
						if direct, err = os.OpenFile(path, os.O_RDWR|unix.O_DIRECT, 0); err != nil {
							t.Fatal(err)
						}
						defer direct.Close()
					}
					// Inside the file: the page before the last, and
					// the last page, which the next write crosses.
					for _, w := range []struct {
						off int64
						n   int
					}{{size - 9000, 1000}, {size - 3000, 1000}} {
						b := fill(w.n, byte(w.off))
						if _, err := f.WriteAt(b, w.off); err != nil {
							t.Fatalf("write of %d bytes at %d, inside the file: %v", w.n, w.off, err)
						}
						copy(model[start+w.off:], b)
					}
					off, over := size-1500, fill(8192, 0x80)
					copy(model[start+off:start+size], over)
					fit := int(size - off)
					switch how {
					case "dd":
						file := filepath.Join(t.TempDir(), "over")
						if err := os.WriteFile(file, over, 0o644); err != nil {
							t.Fatal(err)
						}
						r := harness.Exec(t, "dd", "if="+file, "of="+path, "bs=8192", "count=1", "oflag=seek_bytes",
							fmt.Sprintf("seek=%d", off), "conv=notrunc", "status=none")
						if r.Code == 0 || !strings.Contains(r.Stdout+r.Stderr, "No space left on device") {
							t.Errorf("dd across the end: exit status %d %s; want it to fail with ENOSPC", r.Code, r.Stderr)
						}
						if err := f.Sync(); err != nil && mode == "write-through" {
							t.Errorf("fsync after dd: %v", err)
						}
					default:
						var n int
						if how == "write" {
							if _, err = f.Seek(off, io.SeekStart); err != nil {
								t.Fatal(err)
							}
							n, err = unix.Write(int(f.Fd()), over)
						} else {
							n, err = unix.Pwrite(int(f.Fd()), over, off)
						}
						switch mode {
						case "writeback":
							if err != nil || n != len(over) {
								t.Errorf("write of %d bytes across the end: %d, %v; want all of it taken (the page cache)", len(over), n, err)
							}
							if err := f.Sync(); !errors.Is(err, unix.ENOSPC) {
								t.Errorf("fsync after a write across the end: %v, want ENOSPC", err)
							}
							wantSize("right after the fsync, the writer still open")
						case "write-through":
							if err != nil || n != fit {
								t.Errorf("write of %d bytes across the end: %d, %v; want the %d that fit", len(over), n, err, fit)
							}
							if _, err := unix.Pwrite(int(f.Fd()), over[fit:], size); !errors.Is(err, unix.ENOSPC) {
								t.Errorf("write at the end: %v, want ENOSPC", err)
							}
							if st, err := f.Stat(); err != nil || st.Size() != size {
								t.Errorf("fstat right after the write: %v %v, want size %d", st, err, size)
							}
							if err := f.Sync(); err != nil {
								t.Errorf("fsync: %v", err)
							}
						}
					}
					f.Close()
					direct.Close()
					wantSize("right after the writer closed")
					got := make([]byte, 16384)
					r := harness.Open(t, path)
					if n, err := r.ReadAt(got, size-int64(len(got))); n != len(got) || err != nil {
						t.Errorf("read of the last %d bytes: %d, %v", len(got), n, err)
					} else if i := harness.FirstDiff(got, model[start+size-int64(len(got)):start+size]); i >= 0 {
						t.Errorf("the file reads differently from the model %d bytes before its end", len(got)-i)
					}
					if n, err := r.ReadAt(got, size); n != 0 || err != io.EOF {
						t.Errorf("read at the end: %d bytes, %v; want none (EOF)", n, err)
					}
					r.Close()
					if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("2\n"), 0); err != nil {
						t.Fatal(err)
					}
					wantSize("after the kernel dropped its caches")
					models[c.name] = model
				})
			}
			m.Unmount(t)
			// The images as qemu sees them.
			for _, c := range cases {
				model := models[c.name]
				if model == nil {
					continue // the case failed early
				}
				checkModel(t, c.image, model)
				if got := int64(qemu.Info(t, c.image)["virtual-size"].(float64)); got != diskSize {
					t.Errorf("%s: virtual size %d after the write, want %d", c.name, got, diskSize)
				}
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
	const size = 16 << 20
	m, img, file := mountEmpty(t, harness.Racy, "mix", "16M")
	logMount = m
	buffered := harness.OpenFile(t, file, os.O_RDWR)
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
	if i := harness.FirstDiff(got, model); i >= 0 {
		t.Fatalf("the mount reads differently from the model at byte %d", i)
	}
	buffered.Close()
	m.Unmount(t)
	checkModel(t, img, model) // where it differs: a dirty page written back over a direct write?
}

// directWriters runs fn in n goroutines at once, each with its own
// O_DIRECT descriptor of file and a 64 KiB buffer aligned for it, and
// fails t with the first error.
func directWriters(t *testing.T, file string, n int, fn func(w int, f *os.File, buf []byte) error) {
	t.Helper()
	errs := make(chan error, n)
	for w := range n {
		go func() {
			errs <- func() error {
				f, err := os.OpenFile(file, os.O_RDWR|unix.O_DIRECT, 0)
				if err != nil {
					return err
				}
				defer f.Close()
				buf, err := unix.Mmap(-1, 0, 64<<10, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
				if err != nil {
					return err
				}
				defer unix.Munmap(buf)
				return fn(w, f, buf)
			}()
		}()
	}
	for range n {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
}

// TestDirectWritersParallel: four O_DIRECT writers of one raw file, whose
// writes the kernel sends in parallel (FOPEN_PARALLEL_DIRECT_WRITES, fs/image.go),
// each in a quarter of an empty image, at pseudo-random 4 KiB and 64 KiB
// blocks (some at 1 KiB offsets, so that copy-on-write meets the neighbours'
// allocations); a buffered reader and a shared mapping of the file, both
// filled before the writes, then read what was written, not their cached
// pages. After unmount, qemu-img check is clean and qemu-img convert equals
// the model.
func TestDirectWritersParallel(t *testing.T) {
	const size = 64 << 20
	m, img, file := mountEmpty(t, harness.Racy, "par", "64M")
	logMount = m
	reader := harness.Open(t, file)
	model := make([]byte, size)
	got := make([]byte, size)
	if _, err := reader.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	mapped, err := unix.Mmap(int(reader.Fd()), 0, size, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	// Touch every page, so that the mapping has them all.
	if !bytes.Equal(mapped[:size], got) {
		t.Fatal("the mapping reads differently from read(2)")
	}

	const writers = 4
	directWriters(t, file, writers, func(w int, f *os.File, buf []byte) error {
		h := fnv.New64a()
		quarter := int64(size / writers)
		for i := range 200 {
			h.Write([]byte{byte(w), byte(i), byte(i >> 8)})
			r := h.Sum64()
			n := int64(4096)
			if r%3 == 0 {
				n = 64 << 10
			}
			off := int64(w)*quarter + int64(r>>8)%(quarter/4096-16)*4096
			if r%5 == 0 {
				off += 1024
			}
			for j := range buf[:n] {
				buf[j] = byte(int64(j)+off) ^ byte(w*61+i)
			}
			if _, err := f.WriteAt(buf[:n], off); err != nil {
				return fmt.Errorf("writer %d: write %d at %d: %w", w, n, off, err)
			}
			copy(model[off:off+n], buf[:n]) // each writer has its own quarter
		}
		return nil
	})
	if _, err := reader.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if i := harness.FirstDiff(got, model); i >= 0 {
		t.Fatalf("a buffered reader reads differently from the model at byte %d (its cached page?)", i)
	}
	if i := harness.FirstDiff(mapped[:size], model); i >= 0 {
		t.Fatalf("a shared mapping reads differently from the model at byte %d", i)
	}
	if err := unix.Munmap(mapped); err != nil {
		t.Fatal(err)
	}
	reader.Close()
	m.Unmount(t)
	checkModel(t, img, model)
}
