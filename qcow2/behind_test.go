package qcow2

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"syscall"
	"testing"
	"time"
)

// gatedFile holds every O_DIRECT write until the test lets it go, so that
// writes are in flight (behind.go) for as long as the test wants.
type gatedFile struct {
	WritableFile
	started chan int64 // a direct write's host offset, as it waits
	release chan error // lets one direct write go, failing it with the error
}

func (f *gatedFile) CanWriteDirect() bool { return true }

func (f *gatedFile) WriteDirect(b []byte, off int64) error {
	f.started <- off
	if err := <-f.release; err != nil {
		return err
	}
	_, err := f.WritableFile.WriteAt(b, off)
	return err
}

// TestWriteBehind: a large aligned write returns while its host write is
// still in flight, and the guest cannot tell: a read of its range waits
// for it and reads the new bytes; a later write into its range lands after
// it; a flush waits for it; a write that fails in flight fails the next
// flush, and every later one. qemu-img reads the image back as the model.
func TestWriteBehind(t *testing.T) {
	if _, err := exec.LookPath("qemu-img"); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("qemu-img is needed (package qemu-utils)")
		}
		t.Skip("qemu-img missing")
	}
	const size = 16 << 20
	path := filepath.Join(t.TempDir(), "wb.qcow2")
	if err := Create(path, CreateOptions{Size: size}); err != nil {
		t.Fatal(err)
	}
	lf, err := OpenWritableFile(path)
	if err != nil {
		t.Fatal(err)
	}
	f := &gatedFile{WritableFile: lf, started: make(chan int64, 8), release: make(chan error)}
	img, err := NewImage(f, Options{Writable: true})
	if err != nil || !img.Writable() {
		t.Fatalf("open: %v %s", err, img.ReadOnlyReason())
	}
	b := img.w.behind
	model := make([]byte, size)
	fill := func(off, n int64, c byte) []byte {
		p := bytes.Repeat([]byte{c}, int(n))
		copy(model[off:], p)
		return p
	}
	// inFlight writes p at off and returns once WriteAt has, with the
	// host write waiting at the gate.
	inFlight := func(p []byte, off int64) {
		t.Helper()
		done := make(chan error, 1)
		go func() { _, err := img.WriteAt(p, off); done <- err }()
		<-f.started
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("WriteAt waits for its host write")
		}
	}
	// blocks runs op and returns once it is waiting for a write in
	// flight; op must not have finished by then.
	blocks := func(what string, op func() error) chan error {
		t.Helper()
		done := make(chan error, 1)
		go func() { done <- op() }()
		for b.waiting.Load() == 0 {
			select {
			case err := <-done:
				t.Fatalf("%s finished (%v) while a write into its range was in flight", what, err)
			default:
				runtime.Gosched()
			}
		}
		return done
	}
	readBack := func(what string) {
		t.Helper()
		got := make([]byte, size)
		if _, err := img.ReadAt(got, 0); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, model) {
			t.Fatalf("%s: the disk does not read as the model", what)
		}
	}

	// A read of the range waits, then reads the new bytes.
	inFlight(fill(0, 1<<20, 0xa1), 0)
	got := make([]byte, 64<<10)
	rd := blocks("a read", func() error { _, err := img.ReadAt(got, 512<<10); return err })
	f.release <- nil
	if err := <-rd; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, model[512<<10:576<<10]) {
		t.Fatal("the read returned what was there before the write")
	}
	// So does the host range a zero-copy reader is given (Extent).
	inFlight(fill(4<<20, 1<<20, 0xa2), 4<<20)
	ex := blocks("Extent", func() error { _, err := img.Extent(4<<20+4096, 4096); return err })
	f.release <- nil
	if err := <-ex; err != nil {
		t.Fatal(err)
	}

	// A small write into the range lands after it, not under it.
	inFlight(fill(1<<20, 1<<20, 0xb2), 1<<20)
	wr := blocks("a write into the range", func() error { _, err := img.WriteAt(fill(1<<20+8192, 4096, 0xc3), 1<<20+8192); return err })
	f.release <- nil
	if err := <-wr; err != nil {
		t.Fatal(err)
	}
	readBack("after a write into a range in flight")

	// A flush waits for what is in flight.
	inFlight(fill(2<<20, 1<<20, 0xd4), 2<<20)
	fl := blocks("a flush", img.Flush)
	f.release <- nil
	if err := <-fl; err != nil {
		t.Fatal(err)
	}
	readBack("after a flush")

	// A write that fails in flight fails the next flush, and the ones
	// after it; nothing else is written.
	want := append([]byte(nil), model...)
	inFlight(fill(3<<20, 1<<20, 0xe5), 3<<20)
	f.release <- syscall.EIO
	for i := range 2 {
		if err := img.Flush(); !errors.Is(err, syscall.EIO) {
			t.Fatalf("flush %d after a failed write: %v, want EIO", i+1, err)
		}
	}
	if err := img.Close(); err == nil {
		t.Fatal("Close after a failed write succeeded")
	}

	// On disk: what the last good flush had, as qemu reads it.
	out := filepath.Join(t.TempDir(), "wb.raw")
	if o, err := exec.Command("qemu-img", "convert", "-O", "raw", path, out).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img convert: %v %s", err, o)
	}
	disk, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	copy(want[3<<20:4<<20], make([]byte, 1<<20))
	if !bytes.Equal(disk, want) {
		t.Error("qemu-img convert does not read what was flushed")
	}
	if o, err := exec.Command("qemu-img", "check", path).CombinedOutput(); err != nil {
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 3 {
			t.Errorf("qemu-img check: %v\n%s", err, o)
		}
	}
}
