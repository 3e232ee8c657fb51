package read

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// virtualSize asks qemu-img for an image's virtual size.
func virtualSize(t testing.TB, image string) int64 {
	t.Helper()
	return int64(qemu.Info(t, image)["virtual-size"].(float64))
}

// TestTreeMirrorsSource checks the naming rule, recursion, plain files,
// sizes, times, permissions and inode numbers through a real mount.
func TestTreeMirrorsSource(t *testing.T) {
	src := harness.SourceDir(t)
	for _, p := range []string{"a.qcow2", "disk", "vm.qcow2", "vm.img", "sub/deep/x.QCOW2"} {
		os.MkdirAll(filepath.Dir(filepath.Join(src, p)), 0o755)
		qemu.Create(t, "qcow2", filepath.Join(src, p), "3M")
	}
	qemu.IO(t, filepath.Join(src, "a.qcow2"), "write -P 0x5a 0 64k")
	os.WriteFile(filepath.Join(src, "notes.txt"), []byte("hello\n"), 0o640)
	// Named like an image but not one: shown unchanged.
	os.WriteFile(filepath.Join(src, "fake.qcow2"), []byte("not qcow2"), 0o644)
	// The qcow2 magic alone: a raw file to qemu (whose probe reads the
	// missing version as 0), and so not an image.
	os.WriteFile(filepath.Join(src, "magic.qcow2"), []byte("QFI\xfb"), 0o644)
	// The magic and a version of 0, then bytes: raw to qemu too.
	os.WriteFile(filepath.Join(src, "zero.img"), []byte("QFI\xfb\x00\x00\x00\x00 and more"), 0o644)
	for _, name := range []string{"magic.qcow2", "zero.img"} {
		if out := qemu.Info(t, filepath.Join(src, name)); out["format"] != "raw" {
			t.Fatalf("qemu-img info of %s says format %v, the test expects raw", name, out["format"])
		}
	}

	m := harness.Mount(t, src)

	// vm.img and vm.qcow2 both want vm.raw: vm.img comes first in byte
	// order and gets it; vm.qcow2 falls back to vm.qcow2.raw.
	want := []string{"a.raw", "disk.raw", "fake.qcow2", "magic.qcow2", "notes.txt", "sub", "vm.qcow2.raw", "vm.raw", "zero.img"}
	if got := harness.Names(t, m.Dir); !slices.Equal(got, want) {
		t.Fatalf("mount lists %q, want %q", got, want)
	}
	// A file with the magic that qemu reads as raw is shown as the plain
	// file it is, with one log line naming it (however often it is
	// listed and looked up); the others get none.
	harness.Names(t, m.Dir)
	for _, name := range []string{"magic.qcow2", "zero.img", "fake.qcow2"} {
		if _, err := os.Stat(filepath.Join(m.Dir, name)); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	var said []string
	for _, line := range strings.Split(m.LogText(t), "\n") {
		if strings.Contains(line, "qcow2 magic") {
			said = append(said, line)
		}
	}
	for _, name := range []string{"magic.qcow2", "zero.img"} {
		if n := countContaining(said, "path="+filepath.Join(src, name)+" "); n != 1 {
			t.Errorf("%d log lines name %s as beginning with the qcow2 magic, want 1:\n%s", n, name, strings.Join(said, "\n"))
		}
	}
	if len(said) != 2 {
		t.Errorf("%d log lines about the qcow2 magic, want 2:\n%s", len(said), strings.Join(said, "\n"))
	}
	if got := harness.Names(t, filepath.Join(m.Dir, "sub/deep")); !slices.Equal(got, []string{"x.raw"}) {
		t.Fatalf("sub/deep lists %q", got)
	}

	for exposed, source := range map[string]string{"a.raw": "a.qcow2", "vm.raw": "vm.img", "sub/deep/x.raw": "sub/deep/x.QCOW2"} {
		var st, sst syscall.Stat_t
		if err := syscall.Stat(filepath.Join(m.Dir, exposed), &st); err != nil {
			t.Fatal(err)
		}
		syscall.Stat(filepath.Join(src, source), &sst)
		if st.Size != virtualSize(t, filepath.Join(src, source)) {
			t.Errorf("%s: size %d, qemu-img says %d", exposed, st.Size, virtualSize(t, filepath.Join(src, source)))
		}
		if st.Mode&syscall.S_IFMT != syscall.S_IFREG || st.Mode&0o222 != 0 {
			t.Errorf("%s: mode %o, want a regular file without write bits", exposed, st.Mode)
		}
		if st.Mode&0o555 != sst.Mode&0o555 {
			t.Errorf("%s: mode %o, source has %o", exposed, st.Mode&0o777, sst.Mode&0o777)
		}
		if st.Mtim != sst.Mtim {
			t.Errorf("%s: mtime %v, source has %v", exposed, st.Mtim, sst.Mtim)
		}
	}
	notes, err := os.ReadFile(filepath.Join(m.Dir, "notes.txt"))
	if err != nil || string(notes) != "hello\n" {
		t.Fatalf("notes.txt = %q, %v", notes, err)
	}
	if _, err := os.OpenFile(filepath.Join(m.Dir, "a.raw"), os.O_WRONLY, 0); !errors.Is(err, syscall.EROFS) {
		t.Errorf("opening a.raw for writing: %v, want EROFS", err)
	}
	if err := os.WriteFile(filepath.Join(m.Dir, "new.txt"), nil, 0o644); !errors.Is(err, syscall.EROFS) {
		t.Errorf("creating a file: %v, want EROFS", err)
	}

	// Inode numbers are stable: the same after a remount.
	inode := func(dir string) uint64 {
		var st syscall.Stat_t
		if err := syscall.Stat(filepath.Join(dir, "a.raw"), &st); err != nil {
			t.Fatal(err)
		}
		return st.Ino
	}
	before := inode(m.Dir)
	m.Unmount(t)
	m2 := harness.Mount(t, src)
	if after := inode(m2.Dir); after != before {
		t.Errorf("a.raw inode %d, %d after a remount", before, after)
	}
}

// countContaining counts the lines that contain s.
func countContaining(lines []string, s string) int {
	n := 0
	for _, l := range lines {
		if strings.Contains(l, s) {
			n++
		}
	}
	return n
}

// TestTreeFollowsChanges adds and removes images while mounted.
func TestTreeFollowsChanges(t *testing.T) {
	src := harness.SourceDir(t)
	qemu.Create(t, "qcow2", filepath.Join(src, "one.qcow2"), "1M")
	m := harness.Mount(t, src)
	if got := harness.Names(t, m.Dir); !slices.Equal(got, []string{"one.raw"}) {
		t.Fatalf("lists %q", got)
	}

	qemu.Create(t, "qcow2", filepath.Join(src, "two.qcow2"), "2M")
	qemu.IO(t, filepath.Join(src, "two.qcow2"), "write -P 0x42 4096 4096")
	if got := harness.Names(t, m.Dir); !slices.Equal(got, []string{"one.raw", "two.raw"}) {
		t.Fatalf("after adding two.qcow2, lists %q", got)
	}
	harness.SameFile(t, filepath.Join(m.Dir, "two.raw"), qemu.ToRaw(t, filepath.Join(src, "two.qcow2"), filepath.Join(t.TempDir(), "two")))

	// An image replaced by a new version (written elsewhere, renamed
	// over it: qemu cannot write a shown image in place, see the lock
	// tests) is a new file: it reads its new bytes.
	next := filepath.Join(src, ".two.qcow2.new")
	qemu.Run(t, "cp", filepath.Join(src, "two.qcow2"), next)
	qemu.IO(t, next, "write -P 0x43 0 8192")
	if err := os.Rename(next, filepath.Join(src, "two.qcow2")); err != nil {
		t.Fatal(err)
	}
	harness.Names(t, m.Dir)
	harness.SameFile(t, filepath.Join(m.Dir, "two.raw"), qemu.ToRaw(t, filepath.Join(src, "two.qcow2"), filepath.Join(t.TempDir(), "two")))

	os.Remove(filepath.Join(src, "one.qcow2"))
	if got := harness.Names(t, m.Dir); !slices.Equal(got, []string{"two.raw"}) {
		t.Fatalf("after removing one.qcow2, lists %q", got)
	}
	if f, err := os.Open(filepath.Join(m.Dir, "one.raw")); err == nil {
		f.Close()
		t.Fatal("one.raw still opens after its image was removed")
	}
}

// corruptFirstL2Entry points the first L2 entry of a qcow2 image at a host
// cluster far past the end of the file, keeping the flags.
func corruptFirstL2Entry(t testing.TB, path string) {
	t.Helper()
	at, _ := qemu.L2EntryOffset(t, path, 0)
	qemu.PatchU(t, path, at, 8, 1<<63|1<<40)
}

// TestBadImages checks that an image that fails validation is not shown
// (one log line naming it), and that reads hitting corrupt metadata fail
// with EIO for that read only, logged once, while other images read fine.
func TestBadImages(t *testing.T) {
	src := harness.SourceDir(t)
	good := qemu.Make(t, filepath.Join(src, "good.qcow2"), "4M", "write -P 0x61 0 1M")

	// cluster_bits = 40: refused at open.
	badHeader := filepath.Join(src, "badheader.qcow2")
	qemu.Create(t, "qcow2", badHeader, "4M")
	qemu.PatchU(t, badHeader, qemu.HeaderClusterBits, 4, 40)

	// The first cluster's L2 entry points past the end of the file.
	badL2 := qemu.Make(t, filepath.Join(src, "badl2.qcow2"), "4M", "write -P 0x62 0 256k")
	// What qemu reads of it before the damage, for the intact part.
	pristine := qemu.RawBytes(t, badL2)
	corruptFirstL2Entry(t, badL2)
	// The oracle: qemu-img check calls it corrupt (exit status 2). (qemu
	// itself would read zeros there, as its file driver pads reads past
	// the end of the file; qcowfs fails the read instead of inventing
	// data for a cluster the image does not hold.)
	if r := harness.Exec(t, "qemu-img", "check", badL2); r.Code != 2 {
		t.Fatalf("qemu-img check on the damaged image: exit status %d, want 2\n%s", r.Code, r.Stdout)
	}

	m := harness.Mount(t, src)
	if got := harness.Names(t, m.Dir); !slices.Equal(got, []string{"badl2.raw", "good.raw"}) {
		t.Fatalf("lists %q, want the refused image hidden", got)
	}
	harness.Names(t, m.Dir) // listing again must not log again
	log := m.LogText(t)
	if n := harness.CountLines(log, "badheader.qcow2"); n != 1 || !strings.Contains(log, "cluster_bits") {
		t.Errorf("want exactly one log line naming badheader.qcow2 and cluster_bits, got %d:\n%s", n, log)
	}

	bad := harness.Open(t, filepath.Join(m.Dir, "badl2.raw"))
	buf := make([]byte, 4096)
	for i := 0; i < 3; i++ {
		if _, err := bad.ReadAt(buf, 0); !errors.Is(err, syscall.EIO) {
			t.Fatalf("reading the corrupt cluster: %v, want EIO", err)
		}
	}
	// The rest of that image still reads, and so does the good one.
	if _, err := bad.ReadAt(buf, 128<<10); err != nil || !slices.Equal(buf, pristine[128<<10:132<<10]) {
		t.Errorf("reading an intact cluster of the damaged image: %v, or wrong bytes", err)
	}
	harness.SameFile(t, filepath.Join(m.Dir, "good.raw"), qemu.ToRaw(t, good, filepath.Join(t.TempDir(), "good")))
	if n := harness.CountLines(m.LogText(t), "read failed"); n != 1 {
		t.Errorf("want one 'read failed' log line for badl2, got %d:\n%s", n, m.LogText(t))
	}
}

// TestRootInodeAndDots: the mount root has a real inode number (ls -id
// shows it), and listings include "." and ".." with the inode numbers stat
// reports for the folder and its parent.
func TestRootInodeAndDots(t *testing.T) {
	src := harness.SourceDir(t)
	os.MkdirAll(filepath.Join(src, "sub"), 0o755)
	qemu.Create(t, "qcow2", filepath.Join(src, "sub", "a.qcow2"), "1M")
	m := harness.Mount(t, src)
	ino := func(p string) uint64 {
		var st syscall.Stat_t
		if err := syscall.Stat(p, &st); err != nil {
			t.Fatal(err)
		}
		return st.Ino
	}
	root, sub := ino(m.Dir), ino(filepath.Join(m.Dir, "sub"))
	if root == 0 {
		t.Fatal("the mount root has inode number 0")
	}
	if r := harness.Exec(t, "ls", "-id", m.Dir); r.Code != 0 || strings.HasPrefix(r.Stdout, "?") {
		t.Fatalf("ls -id: exit status %d, %s%s", r.Code, r.Stdout, r.Stderr)
	}
	// ls -ai lists what readdir returns for "." and "..".
	dots := func(dir string) map[string]string {
		r := harness.Exec(t, "ls", "-ai1", dir)
		harness.WantOK(t, "ls -ai1", r)
		got := map[string]string{}
		for _, line := range strings.Split(strings.TrimSpace(r.Stdout), "\n") {
			f := strings.Fields(line)
			if len(f) == 2 {
				got[f[1]] = f[0]
			}
		}
		return got
	}
	d := dots(filepath.Join(m.Dir, "sub"))
	if d["."] != fmt.Sprint(sub) || d[".."] != fmt.Sprint(root) {
		t.Errorf("sub lists . = %s and .. = %s; stat says %d and %d", d["."], d[".."], sub, root)
	}
	if d := dots(m.Dir); d["."] != fmt.Sprint(root) || d["sub"] != fmt.Sprint(sub) {
		t.Errorf("the root lists . = %s, sub = %s; stat says %d and %d", d["."], d["sub"], root, sub)
	}
}

// TestPlainFilesPassthrough: a plain file of the folder is read through
// the mount as the kernel reads the file itself (FUSE passthrough, where
// the kernel offers it): its bytes are the file's, and not one READ
// request reaches the daemon. Where the kernel does not offer it, the
// daemon serves the reads (the same bytes).
func TestPlainFilesPassthrough(t *testing.T) {
	harness.RequireFUSE(t)
	src := t.TempDir()
	want := make([]byte, 4<<20)
	for i := range want {
		want[i] = byte(i*7 + i>>12)
	}
	os.WriteFile(filepath.Join(src, "plain.bin"), want, 0o644)
	m := harness.Mount(t, src, "--debug")
	got, err := os.ReadFile(filepath.Join(m.Dir, "plain.bin"))
	if err != nil || !slices.Equal(got, want) {
		t.Fatalf("reading the plain file through the mount: %v, equal %v", err, slices.Equal(got, want))
	}
	// Whether the kernel offers passthrough: its INIT request says.
	offered := false
	reads := 0
	for _, line := range strings.Split(m.LogText(t), "\n") {
		if strings.Contains(line, ": INIT n") && strings.Contains(line, " rx ") {
			offered = strings.Contains(line, "PASSTHROUGH")
		}
		if strings.Contains(line, ": READ n") {
			reads++
		}
	}
	switch {
	case offered && reads > 0:
		t.Errorf("passthrough was set up, yet %d READ requests reached the daemon", reads)
	case !offered && reads == 0:
		t.Errorf("no passthrough and no READ requests: what served the bytes?")
	}
	t.Logf("passthrough: %v, READ requests: %d", offered, reads)
}
