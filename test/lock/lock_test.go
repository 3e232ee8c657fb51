package lock

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestLockQemuWriting: an image a running qemu has open for writing is not
// served (one log line names the image and the lock), unless --force-share;
// once qemu lets go, it is shown.
func TestLockQemuWriting(t *testing.T) {
	src := harness.SourceDir(t)
	busy := filepath.Join(src, "busy.qcow2")
	qemu.Create(t, "qcow2", busy, "4M")
	qemu.Create(t, "qcow2", filepath.Join(src, "free.qcow2"), "4M")
	_, release := qemu.HoldOpen(t, busy)

	m := harness.Mount(t, src)
	if got := harness.Names(t, m.Dir); !slices.Equal(got, []string{"free.raw"}) {
		t.Fatalf("lists %q; the image qemu writes must not be shown", got)
	}
	harness.Names(t, m.Dir) // tried again, not logged again
	if log := m.LogText(t); harness.CountLines(log, "busy.qcow2") != 1 || !strings.Contains(log, `lock (byte 101)`) {
		t.Errorf("want one log line naming busy.qcow2 and the write lock:\n%s", log)
	}

	shared := harness.Mount(t, src, "--force-share")
	if got := harness.Names(t, shared.Dir); !slices.Equal(got, []string{"busy.raw", "free.raw"}) {
		t.Errorf("with --force-share, lists %q", got)
	}

	release()
	if got := harness.Names(t, m.Dir); !slices.Equal(got, []string{"busy.raw", "free.raw"}) {
		t.Errorf("after qemu closed the image, lists %q", got)
	}
}

// TestLockOnlyWhileOpen: listing and stat take no lock, so qemu writes,
// snapshots and converts images that are shown; while a raw file of an
// image is open, qcowfs holds a reader's locks and qemu cannot open the
// image for writing (qemu's own error), though it can still read it; after
// the last close, qemu can write it again.
func TestLockOnlyWhileOpen(t *testing.T) {
	src := harness.SourceDir(t)
	img := filepath.Join(src, "vm.qcow2")
	qemu.Create(t, "qcow2", img, "4M")
	m := harness.Mount(t, src)
	if got := harness.Names(t, m.Dir); !slices.Equal(got, []string{"vm.raw"}) {
		t.Fatalf("lists %q", got)
	}
	if _, err := os.Stat(filepath.Join(m.Dir, "vm.raw")); err != nil {
		t.Fatal(err)
	}
	// Listed and stat'ed only: no lock in qemu's way.
	qemu.IO(t, img, "write -P 0x11 0 64k")
	qemu.Img(t, "snapshot", "-c", "listed", img)

	lockedWhileOpen(t, filepath.Join(m.Dir, "vm.raw"), img, "write 0 4k")
}

// lockedWhileOpen opens file, a file of a mount that shows img: while it
// is open, qemu cannot write img (qemu-io's write, qemu's own lock error)
// but can read it (qemu-img info); once it is closed (release is
// asynchronous in the kernel: FUSE sends RELEASE after close returns),
// qemu writes it.
func lockedWhileOpen(t *testing.T, file, img, write string) {
	t.Helper()
	f := harness.Open(t, file)
	qemu.WantLocked(t, `Failed to get "write" lock`, "qemu-io", "-f", "qcow2", "-c", write, img)
	qemu.Img(t, "info", img)
	f.Close()
	harness.WaitFor(t, "the image's locks to be dropped after "+filepath.Base(file)+" is closed", 5*time.Second, func() bool {
		return harness.Exec(t, "qemu-io", "-f", "qcow2", "-c", write, img).Code == 0
	})
}

// TestListingNeverBlocksQemu: while a listing loop runs over the mount,
// qemu-img creates, converts, snapshots and writes images in the source
// folder, every time without a lock error.
func TestListingNeverBlocksQemu(t *testing.T) {
	src := harness.SourceDir(t)
	base := filepath.Join(src, "base.qcow2")
	qemu.Create(t, "qcow2", base, "8M")
	m := harness.Mount(t, src)
	stop := make(chan struct{})
	listed := make(chan int)
	go func() {
		n := 0
		for {
			select {
			case <-stop:
				listed <- n
				return
			default:
			}
			entries, _ := os.ReadDir(m.Dir)
			for _, e := range entries {
				e.Info()
			}
			n++
		}
	}()
	for i := 0; i < 20; i++ {
		p := qemu.Make(t, filepath.Join(src, fmt.Sprintf("new%d.qcow2", i)), "4M", "write -P 0x22 0 64k")
		qemu.Img(t, "snapshot", "-c", "s", p)
		qemu.Img(t, "convert", "-O", "qcow2", p, filepath.Join(src, fmt.Sprintf("conv%d.qcow2", i)))
		qemu.IO(t, base, fmt.Sprintf("write -P %d %d 4k", i+1, i*4096))
	}
	close(stop)
	if n := <-listed; n == 0 {
		t.Fatal("the listing loop never completed a listing")
	}
}

// refusalLines returns the log lines that say image is not shown.
func refusalLines(log, image string) []string {
	var out []string
	for _, line := range strings.Split(log, "\n") {
		if strings.Contains(line, `msg="image not shown`) && strings.Contains(line, "image="+image+" ") {
			out = append(out, line)
		}
	}
	return out
}

// TestRefusalLog: an image the mount does not show is logged at WARN (not
// ERROR: the mount works, one image is left out), in one line that names
// the image once, as image=PATH, with the reason and the flag that would
// show it (no empty hint= where no flag would); listing the folder again does not log it again, but a change
// does: the lock let go and taken again, or the image replaced by another
// one that is refused too.
func TestRefusalLog(t *testing.T) {
	src := harness.SourceDir(t)
	busy := filepath.Join(src, "busy.qcow2")
	qemu.Create(t, "qcow2", busy, "4M")
	bad := filepath.Join(src, "bad.qcow2")
	qemu.Create(t, "qcow2", bad, "1M")
	qemu.SetIncompatible(t, bad, 2)
	orphan := filepath.Join(src, "orphan.qcow2")
	qemu.Img(t, "create", "-q", "-u", "-f", "qcow2", "-b", "gone.qcow2", "-F", "qcow2", orphan, "1M")
	_, release := qemu.HoldOpen(t, busy)

	m := harness.Mount(t, src)
	list := func(want []string) {
		t.Helper()
		for i := 0; i < 3; i++ {
			if got := harness.Names(t, m.Dir); !slices.Equal(got, want) {
				t.Fatalf("lists %q, want %q", got, want)
			}
		}
	}
	check := func(image string, n int, hint, reason string) {
		t.Helper()
		log := m.LogText(t)
		lines := refusalLines(log, image)
		if len(lines) != n {
			t.Fatalf("%d log lines say %s is not shown, want %d:\n%s", len(lines), image, n, log)
		}
		for _, l := range lines {
			if !strings.Contains(l, " level=WARN ") || strings.Count(l, image) != 1 || !strings.Contains(l, reason) {
				t.Errorf("log line %q: want level=WARN, %s named once and the reason (%q)", l, image, reason)
			}
			if hint == "" {
				if strings.Contains(l, "hint=") {
					t.Errorf("log line %q: an empty hint", l)
				}
			} else if !strings.Contains(l, " hint="+hint) {
				t.Errorf("log line %q: want hint=%s", l, hint)
			}
		}
		if strings.Contains(log, "level=ERROR") {
			t.Errorf("an image not shown is logged as an error:\n%s", log)
		}
	}
	list([]string{})
	check(busy, 1, "--force-share", `\"write\" lock (byte 101)`)
	check(bad, 1, "--allow-corrupt", "corrupt bit set")
	check(orphan, 1, "", "gone.qcow2") // no flag shows it

	// qemu lets go: shown; qemu opens it again (and writes, as a VM
	// does): hidden, and logged again, once.
	release()
	list([]string{"busy.raw"})
	qemu.IO(t, busy, "write -P 0x33 0 4k")
	qemu.HoldOpen(t, busy)
	list([]string{})
	check(busy, 2, "--force-share", `\"write\" lock (byte 101)`)

	// The corrupt image replaced by another corrupt one: a new file,
	// logged again.
	other := filepath.Join(qemu.TempDir(t), "bad.qcow2")
	qemu.Create(t, "qcow2", other, "2M")
	qemu.SetIncompatible(t, other, 2)
	if err := os.Rename(other, bad); err != nil {
		t.Fatal(err)
	}
	list([]string{})
	check(bad, 2, "--allow-corrupt", "corrupt bit set")
	check(busy, 2, "--force-share", `\"write\" lock (byte 101)`)
}

// TestLockSnapshotAndPartitionFiles: a snapshot file (STEM@NAME.raw) and a
// partition file (STEM.raw.parts/pN) hold the image's reader locks while
// open, as its raw file does: qemu cannot open the image for writing
// (qemu's own lock error) but can read it; after the last close, qemu
// writes it again.
func TestLockSnapshotAndPartitionFiles(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "sfdisk")
	work := t.TempDir()
	disk := filepath.Join(work, "disk.img")
	qemu.Run(t, "truncate", "-s", "8M", disk)
	harness.Partition(t, disk, "label: dos\n,4MiB,83\n")
	src := qemu.TempDir(t)
	img := filepath.Join(src, "vm.qcow2")
	qemu.Img(t, "convert", "-O", "qcow2", disk, img)
	qemu.Img(t, "snapshot", "-c", "before", img)

	m := harness.Mount(t, src)
	for _, name := range []string{"vm@before.raw", filepath.Join("vm.raw.parts", "p1")} {
		t.Run(filepath.Base(name), func(t *testing.T) {
			// Written while closed, after the partition table (the
			// write also makes a new version of the image).
			qemu.IO(t, img, "write -P 0x44 6M 4k")
			lockedWhileOpen(t, filepath.Join(m.Dir, name), img, "write 6M 4k")
		})
	}
}

// holderName is how qcowfs names the qcowfs daemon pid serving mnt as a
// lock holder: with its mount point where the kernel tells which FUSE
// connection a /dev/fuse descriptor serves (its fdinfo's
// "fuse_connection:"; older kernels do not say).
func holderName(t *testing.T, pid int, mnt string) string {
	t.Helper()
	fds, _ := filepath.Glob(fmt.Sprintf("/proc/%d/fd/*", pid))
	for _, fd := range fds {
		if target, _ := os.Readlink(fd); target != "/dev/fuse" {
			continue
		}
		info, _ := os.ReadFile(strings.Replace(fd, "/fd/", "/fdinfo/", 1))
		if strings.Contains(string(info), "fuse_connection:") {
			return fmt.Sprintf("another qcowfs (pid %d, mounted at %s)", pid, mnt)
		}
	}
	return fmt.Sprintf("another qcowfs (pid %d)", pid)
}

// TestTwoWritableMounts: two writable mounts of one folder both come up,
// the second with a warning (on stderr and in its log) naming the first's
// daemon. While one mount has an image open for writing, an open for
// writing in the other fails with EBUSY, whether that mount listed the
// image before (the open collides with the locks) or lists it now (it is
// not shown, and its name answers EBUSY, with O_CREAT too); its log, its
// qcowfs status and the not-shown line of a third mount name the holder:
// the other qcowfs by pid and mount point, or a qemu-io by name and pid.
// Once the holder lets go, the image opens for writing again.
func TestTwoWritableMounts(t *testing.T) {
	src := harness.SourceDir(t)
	img := filepath.Join(src, "vm.qcow2")
	qemu.Create(t, "qcow2", img, "8M")
	a := harness.Mount(t, src, "--writable")
	if strings.Contains(a.Said, "warning") {
		t.Errorf("the first mount warns: %s", a.Said)
	}
	b := harness.Mount(t, src, "--writable")
	pids := harness.Daemons(t, a.Dir)
	if len(pids) != 1 {
		t.Fatalf("want one daemon serving %s, have %v", a.Dir, pids)
	}
	holder := holderName(t, pids[0], a.Dir)
	warning := fmt.Sprintf("%s is already mounted writable by %s", src, holder)
	if !strings.Contains(b.Said, "qcowfs: warning: "+warning) || strings.Count(b.Said, "\n") != 1 {
		t.Errorf("the second mount said %q; want one line: qcowfs: warning: %s ...", b.Said, warning)
	}
	if !strings.Contains(b.LogText(t), warning) {
		t.Errorf("the second mount's log does not warn %q:\n%s", warning, b.LogText(t))
	}

	rawB := filepath.Join(b.Dir, "vm.raw")
	wantBusy := func(what string, flags int) {
		t.Helper()
		f, err := os.OpenFile(rawB, flags, 0o644)
		if err == nil {
			f.Close()
			t.Fatalf("%s: the second mount opened vm.raw for writing", what)
		}
		if !errors.Is(err, syscall.EBUSY) {
			t.Errorf("%s: open for writing in the second mount: %v, want EBUSY", what, err)
		}
	}
	fa := harness.OpenFile(t, filepath.Join(a.Dir, "vm.raw"), os.O_RDWR)
	// Listed by the second mount before: the open meets the locks.
	wantBusy("listed before", os.O_RDWR)
	if log := b.LogText(t); !strings.Contains(log, `in use by `+holder+` holding the \"write\" lock (byte 101)`) {
		t.Errorf("the second mount's log does not name %s as the holder:\n%s", holder, log)
	}
	// Written by the first: a new version, listed again by the second,
	// which does not show it.
	if _, err := fa.WriteAt([]byte("written by the first mount"), 0); err != nil {
		t.Fatal(err)
	}
	if err := fa.Sync(); err != nil {
		t.Fatal(err)
	}
	if got := harness.Names(t, b.Dir); len(got) != 0 {
		t.Errorf("the second mount lists %q while the first writes vm.raw", got)
	}
	wantBusy("not shown", os.O_RDWR)
	wantBusy("not shown, O_CREAT", os.O_RDWR|os.O_CREATE)
	if _, err := os.Stat(rawB); !errors.Is(err, syscall.EBUSY) {
		t.Errorf("stat in the second mount: %v, want EBUSY", err)
	}
	st, out := harness.StatusOf(t, b.Dir)
	if len(st.Refused) != 1 || st.Refused[0].Image != img || !strings.Contains(st.Refused[0].Reason, "in use by "+holder) || st.Refused[0].Hint != "" {
		t.Errorf("qcowfs status of the second mount: %+v; want %s refused, in use by %s, no hint (a writable mount cannot share):\n%s", st.Refused, img, holder, out)
	}
	// A third mount, read-only, says at once why it does not show it.
	c := harness.Mount(t, src)
	if want := "qcowfs: not shown: " + img + ": in use by " + holder + ` holding the "write" lock (byte 101)`; !strings.Contains(c.Said, want) {
		t.Errorf("a read-only mount said %q; want %q", c.Said, want)
	}

	fa.Close()
	harness.WaitFor(t, "the first mount's locks to go with its last close", 5*time.Second, func() bool {
		f, err := os.OpenFile(rawB, os.O_RDWR, 0)
		if err == nil {
			f.Close()
		}
		return err == nil
	})

	// The kernel tells the second mount of that last close after
	// close returns (FUSE_RELEASE): its locks go then.
	harness.WaitFor(t, "the second mount to close the image", 5*time.Second, func() bool {
		st, _ := harness.StatusOf(t, b.Dir)
		return st.OpenEntry(img) == nil
	})

	// A qemu-io writing the image is named as such.
	qemu.IO(t, img, "write -P 0x5a 64k 4k")
	qpid, release := qemu.HoldOpen(t, img)
	wantBusy("qemu-io holds it", os.O_RDWR)
	qholder := fmt.Sprintf("qemu-io (pid %d)", qpid)
	st, out = harness.StatusOf(t, b.Dir)
	if len(st.Refused) != 1 || !strings.Contains(st.Refused[0].Reason, "in use by "+qholder) {
		t.Errorf("qcowfs status of the second mount: %+v; want %s refused, in use by %s:\n%s", st.Refused, img, qholder, out)
	}
	if log := b.LogText(t); !strings.Contains(log, "in use by "+qholder) {
		t.Errorf("the second mount's log does not name %s:\n%s", qholder, log)
	}
	release()
	harness.WaitFor(t, "qemu-io's locks to go", 5*time.Second, func() bool {
		f, err := os.OpenFile(rawB, os.O_RDWR, 0)
		if err == nil {
			f.Close()
		}
		return err == nil
	})
}
