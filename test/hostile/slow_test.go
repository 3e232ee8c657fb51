package hostile

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

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

func (f *stuckFile) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	return nil, fuse.FOPEN_DIRECT_IO, 0
}

func (f *stuckFile) Read(ctx context.Context, fh gofs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	f.once.Do(func() { close(f.reached) })
	select {
	case <-f.gate:
	case <-ctx.Done():
		return nil, syscall.EINTR
	}
	if off >= int64(len(f.data)) {
		return fuse.ReadResultData(nil), 0
	}
	return fuse.ReadResultData(f.data[off:min(int64(len(f.data)), off+int64(len(dest)))]), 0
}

func (f *stuckFile) Getattr(ctx context.Context, fh gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = syscall.S_IFREG | 0o444
	out.Size = uint64(len(f.data))
	return 0
}

// TestHostileStuckDisk: one folder of the source is a file system whose
// reads hang (served here, by the test), holding an image. While qcowfs
// waits on it, listings of the other folders and reads of their images
// answer, a second image in the stuck folder is not needed for them, and
// once the disk answers the stuck folder is listed too.
func TestHostileStuckDisk(t *testing.T) {
	harness.RequireFUSE(t)
	src := qemu.TempDir(t)
	img := filepath.Join(t.TempDir(), "stuck.qcow2")
	qemu.Create(t, "qcow2", img, "1M")
	qemu.IO(t, img, "write -P 0x71 0 64k")
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
			root.AddChild("stuck.qcow2", root.NewPersistentInode(ctx, stuck, gofs.StableAttr{Mode: syscall.S_IFREG}), false)
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
	canary := filepath.Join(fast, "canary.qcow2")
	qemu.Create(t, "qcow2", canary, "1M")
	qemu.IO(t, canary, "write -P 0x61 0 1M")

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
