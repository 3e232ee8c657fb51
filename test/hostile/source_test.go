package hostile

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestHostileShrunkHostFile: an image file truncated while the mount has
// it open. Reads past the new end fail with EIO on both read paths (the
// zero-copy one ends neither silently early nor with stale bytes), a
// whole-file copy fails rather than ending short, and nothing read
// before (another image's bytes, in pooled buffers) is ever served.
func TestHostileShrunkHostFile(t *testing.T) {
	harness.RequireFUSE(t)
	for _, readPath := range []string{"splice", "copy"} {
		t.Run(readPath, func(t *testing.T) {
			src := qemu.TempDir(t)
			canary := qemu.Make(t, filepath.Join(src, "canary.qcow2"), "4M", "write -P 0xca 0 4M")
			// One contiguous run of data clusters (one host range per
			// read), and one with zero clusters between data ones
			// (several ranges per read, gathered in a pipe).
			qemu.Make(t, filepath.Join(src, "one.qcow2"), "4M", "write -P 0x5a 0 4M")
			var cmds []string
			for off := 0; off < 4<<20; off += 128 << 10 {
				cmds = append(cmds, fmt.Sprintf("write -P 0x5b %d 64k", off))
			}
			qemu.Make(t, filepath.Join(src, "many.qcow2"), "4M", cmds...)
			m := harness.Mount(t, src, "--read-path="+readPath)
			canaryRaw := qemu.ToRaw(t, canary, filepath.Join(t.TempDir(), "canary.raw"))

			for _, name := range []string{"one", "many"} {
				f := harness.Open(t, filepath.Join(m.Dir, name+".raw"))
				// The data of guest offsets past 1 MiB goes away.
				img := filepath.Join(src, name+".qcow2")
				at, e := qemu.L2EntryOffset(t, img, 8)
				host := int64(e & qemu.OffsetMask)
				if host <= at {
					t.Fatalf("%s: data cluster 8 at %#x lies before its L2 table", name, host)
				}
				// Fill the daemon's buffers with the canary's bytes.
				harness.SameFile(t, filepath.Join(m.Dir, "canary.raw"), canaryRaw)
				if err := os.Truncate(img, host); err != nil {
					t.Fatal(err)
				}
				b, err := harness.Within(t, "reading past the new end", 20*time.Second, func() ([]byte, error) {
					b := make([]byte, 1<<20)
					n, err := f.ReadAt(b, 2<<20)
					return b[:n], err
				})
				if !errIs(err, unix.EIO) {
					t.Errorf("%s: read past the shrunk file: %d bytes, %v; want EIO", name, len(b), err)
				}
				if bytes.Contains(b, []byte{0xca, 0xca, 0xca, 0xca}) {
					t.Errorf("%s: served the canary's bytes", name)
				}
				// A copy of the whole disk fails; it does not end early.
				n, err := harness.Within(t, "copying the disk", 30*time.Second, func() (int64, error) {
					g, err := os.Open(filepath.Join(m.Dir, name+".raw"))
					if err != nil {
						return 0, err
					}
					defer g.Close()
					return io.Copy(io.Discard, g)
				})
				if err == nil || !errIs(err, unix.EIO) {
					t.Errorf("%s: copying the disk: %d bytes, %v; want EIO (not an early end)", name, n, err)
				}
			}
			harness.SameFile(t, filepath.Join(m.Dir, "canary.raw"), canaryRaw)
			m.NoPanics(t)
			if log := m.LogText(t); !strings.Contains(log, "short read") {
				t.Errorf("no log line names the short read:\n%s", log)
			}
		})
	}
}

// TestHostileSwappedFolder: a folder of the mount, held open (a directory
// handle, a process's working folder), is replaced in the source by a
// symlink to a folder outside the source. Nothing from outside is served:
// not through the handle, not to the process in it, not to a fresh
// lookup.
func TestHostileSwappedFolder(t *testing.T) {
	src := harness.SourceDir(t)
	outside := t.TempDir()
	sub := filepath.Join(src, "sub")
	os.Mkdir(sub, 0o755)
	qemu.Make(t, filepath.Join(sub, "inner.qcow2"), "1M", "write -P 0x11 0 64k")
	qemu.Make(t, filepath.Join(outside, "inner.qcow2"), "1M", "write -P 0xee 0 1M")
	os.WriteFile(filepath.Join(outside, "secret.txt"), []byte("OUTSIDE-SECRET"), 0o644)
	m := harness.Mount(t, src)

	d := harness.Open(t, filepath.Join(m.Dir, "sub"))
	if got := listWithin(t, filepath.Join(m.Dir, "sub"), 10*time.Second); !slices.Contains(got, "inner.raw") {
		t.Fatalf("sub lists %q", got)
	}
	// A process working in the folder, waiting for the swap.
	sh := exec.Command("sh", "-c", "read x; cat secret.txt inner.raw 2>&1 | head -c 64; ls")
	sh.Dir = filepath.Join(m.Dir, "sub")
	stdin, _ := sh.StdinPipe()
	var shOut bytes.Buffer
	sh.Stdout, sh.Stderr = &shOut, &shOut
	if err := sh.Start(); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(sub, filepath.Join(src, "sub.orig")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, sub); err != nil {
		t.Fatal(err)
	}
	stdin.Write([]byte("go\n"))
	stdin.Close()
	harness.Within(t, "the shell in the swapped folder", 20*time.Second, func() (int, error) { return 0, sh.Wait() })
	if strings.Contains(shOut.String(), "OUTSIDE") || strings.Contains(shOut.String(), "\xee\xee") {
		t.Errorf("a process in the swapped folder read from outside:\n%q", shOut.String())
	}
	// Through the held handle.
	for _, name := range []string{"secret.txt", "inner.raw"} {
		fd, err := unix.Openat(int(d.Fd()), name, unix.O_RDONLY, 0)
		if err != nil {
			continue
		}
		b := make([]byte, 64)
		n, _ := unix.Pread(fd, b, 0)
		unix.Close(fd)
		if bytes.Contains(b[:n], []byte("OUTSIDE")) || bytes.Contains(b[:n], []byte{0xee, 0xee}) {
			t.Errorf("openat(held handle, %s) served bytes from outside: %q", name, b[:n])
		}
	}
	d.Seek(0, io.SeekStart)
	if names, err := d.Readdirnames(-1); err == nil && slices.Contains(names, "secret.txt") {
		t.Errorf("the held handle lists the outside folder: %q", names)
	}
	// A fresh lookup: sub is a symlink leading outside, so not shown.
	if got := listWithin(t, m.Dir, 10*time.Second); slices.Contains(got, "sub") {
		t.Errorf("the root lists %q: sub now leads outside", got)
	}
	if b, err := os.ReadFile(filepath.Join(m.Dir, "sub", "secret.txt")); err == nil {
		t.Errorf("read %q through the swapped folder", b)
	}
	// The folder that moved is served under its new name, and an image
	// that moves too (nodes keep the path they were looked up at).
	if got := listWithin(t, filepath.Join(m.Dir, "sub.orig"), 10*time.Second); !slices.Contains(got, "inner.raw") {
		t.Errorf("sub.orig lists %q", got)
	}
	if b, err := probeImage(t, filepath.Join(m.Dir, "sub.orig", "inner.raw")); err != nil || b[0] != 0x11 {
		t.Errorf("sub.orig/inner.raw: %v", err)
	}
	os.Rename(filepath.Join(src, "sub.orig", "inner.qcow2"), filepath.Join(src, "sub.orig", "moved.qcow2"))
	if b, err := probeImage(t, filepath.Join(m.Dir, "sub.orig", "moved.raw")); err != nil || b[0] != 0x11 {
		t.Errorf("sub.orig/moved.raw, renamed from inner.qcow2: %v", err)
	}
	m.NoPanics(t)
}

// TestHostileSpecialFiles: a fifo and a block device node (a loop device
// over a file outside the source) in the source folder, named as the
// backing file or the data file of images. Each image is refused with a
// log line naming the file type; nothing hangs, the canary reads, and the
// device's bytes are never served.
func TestHostileSpecialFiles(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "losetup")
	src := qemu.TempDir(t)
	outside := filepath.Join(t.TempDir(), "secret.img")
	qemu.Create(t, "raw", outside, "1M")
	qemu.Run(t, "sh", "-c", "yes DEVICE-SECRET | head -c 1048576 | dd of="+outside+" conv=notrunc status=none")
	dev := strings.TrimSpace(string(qemu.Run(t, "losetup", "-f", "--show", "-r", outside)))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mknod(filepath.Join(src, "blk"), unix.S_IFBLK|0o600, int(st.Rdev)); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mkfifo(filepath.Join(src, "fifo"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, node := range []string{"blk", "fifo"} {
		qemu.Img(t, "create", "-q", "-f", "qcow2", "-u", "-b", node, "-F", "raw", filepath.Join(src, "backing-"+node+".qcow2"), "1M")
		// A data file image: made with a regular data file, which is
		// then replaced by a symlink to the node.
		img := filepath.Join(src, "data-"+node+".qcow2")
		data := filepath.Join(src, "data-"+node+".data")
		qemu.Img(t, "create", "-q", "-f", "qcow2", "-o", "data_file="+data+",data_file_raw=on", img, "1M")
		os.Remove(data)
		os.Symlink(node, data)
	}
	// A fifo named like an image.
	unix.Mkfifo(filepath.Join(src, "fifo.qcow2"), 0o600)
	makeCanary(t, src)

	m := harness.Mount(t, src)
	listed := listWithin(t, m.Dir, 20*time.Second)
	for _, name := range []string{"backing-blk", "backing-fifo", "data-blk", "data-fifo", "fifo"} {
		if slices.Contains(listed, name+".raw") {
			b, _ := probeImage(t, filepath.Join(m.Dir, name+".raw"))
			if bytes.Contains(b, []byte("DEVICE-SECRET")) {
				t.Errorf("%s.raw serves the device's bytes", name)
			}
			t.Errorf("%s.raw is shown; its backing or data file is not a regular file", name)
		}
	}
	for _, n := range []string{"blk", "fifo"} {
		if slices.Contains(listed, n) {
			t.Errorf("the special file %s is shown", n)
		}
	}
	log := m.LogText(t)
	for name, what := range map[string]string{"backing-blk": "a block device", "backing-fifo": "a fifo", "data-blk": "a block device", "data-fifo": "a fifo"} {
		if !strings.Contains(log, filepath.Join(src, name+".qcow2")) || !strings.Contains(log, what) {
			t.Errorf("no log line says %s.qcow2's file is %s:\n%s", name, what, log)
		}
	}
	checkCanary(t, m.Dir)
	m.NoPanics(t)
	var hostile []string
	for _, name := range []string{"backing-blk", "backing-fifo", "data-blk", "data-fifo"} {
		hostile = append(hostile, filepath.Join(src, name+".qcow2"))
	}
	boundedAll(t, hostile)
}

// stuckFile is a file whose reads wait until gate closes: an image on a
// disk that stopped answering.
type stuckFile struct {
	gofs.Inode
	data    []byte
	gate    chan struct{}
	reached chan struct{} // closed by the first read
	once    sync.Once
}

var (
	_ = (gofs.NodeOpener)((*stuckFile)(nil))
	_ = (gofs.NodeReader)((*stuckFile)(nil))
	_ = (gofs.NodeGetattrer)((*stuckFile)(nil))
)

func (f *stuckFile) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, unix.Errno) {
	return nil, fuse.FOPEN_DIRECT_IO, 0
}

func (f *stuckFile) Read(ctx context.Context, fh gofs.FileHandle, dest []byte, off int64) (fuse.ReadResult, unix.Errno) {
	f.once.Do(func() { close(f.reached) })
	select {
	case <-f.gate:
	case <-ctx.Done():
		return nil, unix.EINTR
	}
	if off >= int64(len(f.data)) {
		return fuse.ReadResultData(nil), 0
	}
	return fuse.ReadResultData(f.data[off:min(int64(len(f.data)), off+int64(len(dest)))]), 0
}

func (f *stuckFile) Getattr(ctx context.Context, fh gofs.FileHandle, out *fuse.AttrOut) unix.Errno {
	out.Mode = unix.S_IFREG | 0o444
	out.Size = uint64(len(f.data))
	return 0
}

// TestHostileStuckDisk: one folder of the source is a file system whose
// reads hang (served here, by the test), holding an image. While qcowfs
// waits on it, listings of the other folders and reads of their images
// answer, a second image in the stuck folder is not needed for them, and
// once the disk answers the stuck folder is listed too.
func TestHostileStuckDisk(t *testing.T) {
	src := harness.SourceDir(t)
	img := qemu.Make(t, filepath.Join(t.TempDir(), "stuck.qcow2"), "1M", "write -P 0x71 0 64k")
	data, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	stuck := &stuckFile{data: data, gate: make(chan struct{}), reached: make(chan struct{})}
	released := false
	release := func() {
		if !released {
			released = true
			close(stuck.gate)
		}
	}
	defer release()
	slow := filepath.Join(src, "slow")
	os.Mkdir(slow, 0o755)
	root := &gofs.Inode{}
	server, err := gofs.Mount(slow, root, &gofs.Options{
		MountOptions: fuse.MountOptions{FsName: "stuck", DirectMount: true},
		OnAdd: func(ctx context.Context) {
			root.AddChild("stuck.qcow2", root.NewPersistentInode(ctx, stuck, gofs.StableAttr{Mode: unix.S_IFREG}), false)
		},
	})
	if err != nil {
		t.Fatalf("serving the stuck folder: %v", err)
	}
	defer func() {
		release()
		server.Unmount()
	}()
	fast := filepath.Join(src, "fast")
	os.Mkdir(fast, 0o755)
	makeCanary(t, fast)

	m := harness.Mount(t, src)
	// Someone lists the stuck folder: qcowfs reads the image's header
	// and waits.
	stuckList := make(chan []string, 1)
	go func() {
		f, err := os.Open(filepath.Join(m.Dir, "slow"))
		if err != nil {
			stuckList <- nil
			return
		}
		defer f.Close()
		names, _ := f.Readdirnames(-1)
		stuckList <- names
	}()
	select {
	case <-stuck.reached:
	case <-time.After(20 * time.Second):
		t.Fatal("qcowfs never read the stuck image")
	}
	for i := 0; i < 3; i++ {
		if got := listWithin(t, filepath.Join(m.Dir, "fast"), 10*time.Second); !slices.Contains(got, "canary.raw") {
			t.Fatalf("fast lists %q", got)
		}
		if b, err := probeImage(t, filepath.Join(m.Dir, "fast", "canary.raw")); err != nil || b[0] != 0x61 {
			t.Fatalf("the canary: %v", err)
		}
		listWithin(t, m.Dir, 10*time.Second)
	}
	select {
	case names := <-stuckList:
		t.Fatalf("the stuck folder listed %q before its disk answered", names)
	default:
	}
	release()
	select {
	case names := <-stuckList:
		if !slices.Contains(names, "stuck.raw") {
			t.Errorf("the stuck folder lists %q once its disk answers", names)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the stuck folder's listing did not finish after its disk answered")
	}
	m.NoPanics(t)
}
