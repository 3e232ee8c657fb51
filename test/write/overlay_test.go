package write

import (
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// Overlay mode (--writable --overlay DIR): the originals are never
// written; the first write to an image makes DIR/REL, a qcow2 with the
// original as backing file. qemu is the oracle: qemu-img check and info of
// the overlays, qemu-img convert of them against a raw model.

// TestOverlayWrites: the write matrix's images (and one in a sub-folder)
// written through an overlay mount. After unmount no file of the source
// has changed; each written image has an overlay at DIR/REL that qemu-img
// check finds clean, that qemu-img info says has the original (absolute
// path, format qcow2) as backing file and the original's cluster size,
// and whose qemu-img convert equals the raw model, discarded clusters
// zero in qemu-img map; an image only read (and one opened for writing
// but not written) has no overlay. A second mount with the same DIR reads
// the same and appends to the same overlays; deleting an overlay shows
// the original again.
func TestOverlayWrites(t *testing.T) {
	src := harness.SourceDir(t)
	work := t.TempDir()
	ov := filepath.Join(t.TempDir(), "overlays")
	images := qemu.WriteMatrix(t, src)
	os.Mkdir(filepath.Join(src, "vms"), 0o755)
	deep := filepath.Join(src, "vms", "deep.qcow2")
	qemu.Create(t, "qcow2", deep, "24M", "-o", "cluster_size=4096")
	qemu.Run(t, "qemu-io", "-c", "write -P 0x5a 1M 3M", deep)
	images = append(images, qemu.WriteImage{Image: qemu.Image{Name: "vms/deep", Path: deep}, ClusterSize: 4096})
	readOnly := filepath.Join(src, "only-read.qcow2")
	qemu.Create(t, "qcow2", readOnly, "8M")
	qemu.Run(t, "qemu-io", "-c", "write -P 0x11 0 1M", readOnly)
	realSrc, err := filepath.EvalSymlinks(src)
	if err != nil {
		t.Fatal(err)
	}
	before := harness.ReadTree(t, src)

	type state struct {
		im     qemu.WriteImage
		model  []byte
		zeroed map[int64]bool
	}
	var all []*state
	for _, im := range images {
		s := &state{im: im, zeroed: map[int64]bool{}}
		if s.model, err = os.ReadFile(qemu.ToRaw(t, im.Path, filepath.Join(work, strings.ReplaceAll(im.Name, "/", "_")+".before"))); err != nil {
			t.Fatal(err)
		}
		all = append(all, s)
	}
	apply := func(m *harness.Mounted, round string, n int) {
		for _, s := range all {
			f := harness.OpenFile(t, filepath.Join(m.Dir, s.im.Name+".raw"), os.O_RDWR)
			h := fnv.New64a()
			h.Write([]byte(round + s.im.Name))
			for _, op := range qemu.Ops(h.Sum64(), n, int64(len(s.model)), s.im.ClusterSize) {
				applyThrough(t, f, op)
				s.model = op.Apply(s.model)
				noteZeroed(s.zeroed, op, s.im.ClusterSize)
			}
			if err := f.Close(); err != nil {
				t.Errorf("%s: close: %v", s.im.Name, err)
			}
			got, err := os.ReadFile(filepath.Join(m.Dir, s.im.Name+".raw"))
			if err != nil {
				t.Fatal(err)
			}
			if i := harness.FirstDiff(got, s.model); i >= 0 {
				t.Errorf("%s: the mount reads differently from the model at byte %d (lengths %d, %d)", s.im.Name, i, len(got), len(s.model))
			}
		}
	}
	logMount = nil

	m := harness.Racy.Mount(t, src, "--writable", "--overlay", ov)
	logMount = m
	// Read one image whole, open another for writing without a write.
	if _, err := os.ReadFile(filepath.Join(m.Dir, "only-read.raw")); err != nil {
		t.Fatal(err)
	}
	if f, err := os.OpenFile(filepath.Join(m.Dir, "only-read.raw"), os.O_RDWR, 0); err != nil {
		t.Fatal(err)
	} else {
		f.Close()
	}
	apply(m, "first", 30)
	logMount = nil
	m.Unmount(t)

	harness.CompareTrees(t, harness.ReadTree(t, src), before) // the source is untouched
	if _, err := os.Lstat(filepath.Join(ov, "only-read.qcow2")); !os.IsNotExist(err) {
		t.Errorf("an image never written has an overlay (%v)", err)
	}
	inodes := map[string]os.FileInfo{}
	check := func(t *testing.T, s *state) string {
		t.Helper()
		o := filepath.Join(ov, s.im.Name+".qcow2")
		checkModel(t, o, s.model)
		in := qemu.Info(t, o)
		orig := filepath.Join(realSrc, s.im.Name+".qcow2")
		if in["format"] != "qcow2" || in["backing-filename"] != orig || in["backing-filename-format"] != "qcow2" ||
			in["cluster-size"] != float64(s.im.ClusterSize) || in["virtual-size"] != float64(len(s.model)) {
			t.Errorf("qemu-img info of the overlay: %v; want backing file %s, format qcow2, cluster size %d, size %d", in, orig, s.im.ClusterSize, len(s.model))
		}
		for _, e := range qemu.Map(t, o) {
			for c := e.Start / s.im.ClusterSize; c < (e.Start+e.Length)/s.im.ClusterSize; c++ {
				if s.zeroed[c] && (e.Data || !e.Zero) {
					t.Errorf("cluster %d was discarded or zeroed last, qemu-img map of the overlay says %+v", c, e)
					break
				}
			}
		}
		return o
	}
	for _, s := range all {
		t.Run("first/"+s.im.Name, func(t *testing.T) {
			o := check(t, s)
			st, err := os.Stat(o)
			if err != nil {
				t.Fatal(err)
			}
			inodes[s.im.Name] = st
		})
	}

	// Again with the same folder: the same bytes, more writes into the
	// same overlay files.
	m = harness.Racy.Mount(t, src, "--writable", "--overlay", ov)
	for _, s := range all {
		got, err := os.ReadFile(filepath.Join(m.Dir, s.im.Name+".raw"))
		if err != nil {
			t.Fatal(err)
		}
		if i := harness.FirstDiff(got, s.model); i >= 0 {
			t.Errorf("%s: the second mount reads differently from the model at byte %d", s.im.Name, i)
		}
	}
	for _, s := range all {
		if len(s.im.Snapshots) > 0 {
			// The original's snapshots are still shown, read-only.
			p := filepath.Join(m.Dir, s.im.Name+"@"+s.im.Snapshots[0]+".raw")
			if _, err := os.OpenFile(p, os.O_RDWR, 0); !errors.Is(err, syscall.EROFS) {
				t.Errorf("snapshot %s of an overlaid image: open for writing: %v, want EROFS", p, err)
			}
		}
	}
	apply(m, "second", 10)
	m.Unmount(t)
	harness.CompareTrees(t, harness.ReadTree(t, src), before) // the source is untouched
	for _, s := range all {
		t.Run("second/"+s.im.Name, func(t *testing.T) {
			o := check(t, s)
			st, err := os.Stat(o)
			if err != nil {
				t.Fatal(err)
			}
			if !os.SameFile(st, inodes[s.im.Name]) {
				t.Errorf("the second mount made a new overlay instead of appending to %s", o)
			}
		})
	}

	// Without its overlay, an image reads as the original again.
	s := all[0]
	if err := os.Remove(filepath.Join(ov, s.im.Name+".qcow2")); err != nil {
		t.Fatal(err)
	}
	m = harness.Mount(t, src, "--writable", "--overlay", ov)
	harness.SameFile(t, filepath.Join(m.Dir, s.im.Name+".raw"), filepath.Join(work, s.im.Name+".before"))
	m.Unmount(t)
}

// TestOverlayRules: --overlay needs --writable, and a folder outside the
// source and the mount point (one-line errors, exit status, nothing
// mounted); plain files stay read-only; an overlay that names another
// backing file is refused with a message naming both, while the mount's
// other images work.
func TestOverlayRules(t *testing.T) {
	src := harness.SourceDir(t)
	qemu.Create(t, "qcow2", filepath.Join(src, "a.qcow2"), "8M")
	qemu.Create(t, "qcow2", filepath.Join(src, "b.qcow2"), "8M")
	os.WriteFile(filepath.Join(src, "notes.txt"), []byte("plain\n"), 0o644)
	mnt := t.TempDir()
	for _, c := range []struct {
		args []string
		want string
		code int
	}{
		{[]string{"--overlay", t.TempDir()}, "--overlay needs --writable", 2},
		{[]string{"--writable", "--overlay", filepath.Join(src, "ov")}, "inside the source folder", 1},
		{[]string{"--writable", "--overlay", filepath.Dir(src)}, "holds the source folder", 1},
		{[]string{"--writable", "--overlay", filepath.Join(mnt, "ov")}, "inside the mount point", 1},
		{[]string{"--writable", "-o", "overlay=" + filepath.Join(src, "x")}, "inside the source folder", 1},
	} {
		r := harness.Run(t, append(append([]string{"mount"}, c.args...), src, mnt)...)
		out, code := r.Stdout+r.Stderr, r.Code
		if code != c.code || !strings.Contains(out, c.want) || strings.Count(strings.TrimSpace(out), "\n") > 1 {
			t.Errorf("qcowfs mount %v: exit %d, %q; want exit %d and a line saying %q", c.args, code, out, c.code, c.want)
		}
		if harness.IsMounted(mnt) {
			t.Fatalf("qcowfs mount %v left a mount", c.args)
		}
	}
	if _, err := os.Stat(filepath.Join(src, "ov")); !os.IsNotExist(err) {
		t.Errorf("a refused overlay folder was made inside the source (%v)", err)
	}

	// An overlay of a.qcow2 that names another backing file.
	ov := t.TempDir()
	other := filepath.Join(t.TempDir(), "other.qcow2")
	qemu.Create(t, "qcow2", other, "8M")
	qemu.Img(t, "create", "-q", "-f", "qcow2", "-b", other, "-F", "qcow2", filepath.Join(ov, "a.qcow2"))
	m := harness.Mount(t, src, "--writable", "--overlay", ov, "--allow-backing-outside", filepath.Dir(other))
	if _, err := os.ReadFile(filepath.Join(m.Dir, "a.raw")); err == nil {
		t.Errorf("a.raw readable through an overlay that names %s as its backing file", other)
	}
	if err := os.WriteFile(filepath.Join(m.Dir, "b.raw"), []byte("b"), 0); err == nil {
		t.Errorf("b.raw written with O_TRUNC")
	}
	f := harness.OpenFile(t, filepath.Join(m.Dir, "b.raw"), os.O_WRONLY)
	if _, err := f.WriteAt([]byte("b"), 0); err != nil {
		t.Errorf("b.raw beside a refused overlay: %v", err)
	}
	f.Close()
	if _, err := os.OpenFile(filepath.Join(m.Dir, "notes.txt"), os.O_WRONLY, 0); err == nil {
		t.Errorf("a plain file opened for writing in overlay mode")
	}
	m.Unmount(t)
	log := m.LogText(t)
	if !strings.Contains(log, "does not belong to") || !strings.Contains(log, other) {
		t.Errorf("the log does not say why a.qcow2's overlay was refused:\n%s", log)
	}
	if _, err := os.Stat(filepath.Join(ov, "b.qcow2")); err != nil {
		t.Errorf("b.qcow2 has no overlay after a write: %v", err)
	}
}

// TestOverlayCrash: the daemon killed (SIGKILL) after an overlay was
// written under its temporary name, before it was renamed into place:
// there is no overlay, the original is unchanged, and the next mount
// makes the overlay and writes through it.
func TestOverlayCrash(t *testing.T) {
	src := harness.SourceDir(t)
	img := filepath.Join(src, "c.qcow2")
	qemu.Create(t, "qcow2", img, "16M")
	qemu.Run(t, "qemu-io", "-c", "write -P 0x33 0 2M", img)
	before := harness.ReadTree(t, src)
	ov := t.TempDir()

	t.Setenv("QCOWFS_TEST_KILL_AT", "overlay-prepared")
	m := harness.Mount(t, src, "--writable", "--overlay", ov)
	f := harness.OpenFile(t, filepath.Join(m.Dir, "c.raw"), os.O_WRONLY)
	if _, err := f.WriteAt([]byte("lost"), 4096); err == nil {
		if err = f.Sync(); err == nil {
			t.Fatal("a write whose overlay creation was killed succeeded")
		}
	}
	f.Close()
	exec.Command("umount", "-l", m.Dir).Run()
	temps, _ := filepath.Glob(filepath.Join(ov, ".c.qcow2.tmp-*"))
	if len(temps) != 1 {
		t.Errorf("want the killed daemon's temporary file in %s, found %v", ov, temps)
	}
	if _, err := os.Lstat(filepath.Join(ov, "c.qcow2")); !os.IsNotExist(err) {
		t.Fatalf("a crash during overlay creation left an overlay (%v)", err)
	}
	harness.CompareTrees(t, harness.ReadTree(t, src), before) // the source is untouched

	os.Unsetenv("QCOWFS_TEST_KILL_AT")
	m = harness.Mount(t, src, "--writable", "--overlay", ov)
	f = harness.OpenFile(t, filepath.Join(m.Dir, "c.raw"), os.O_WRONLY)
	if _, err := f.WriteAt([]byte("kept"), 4096); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	m.Unmount(t)
	harness.CompareTrees(t, harness.ReadTree(t, src), before) // the source is untouched
	o := filepath.Join(ov, "c.qcow2")
	qemu.CheckClean(t, o)
	raw := qemu.RawBytes(t, o)
	if string(raw[4096:4100]) != "kept" || raw[0] != 0x33 || raw[2<<20] != 0 {
		t.Errorf("the overlay made after the crash reads %q at 4096, %#x at 0", raw[4096:4100], raw[0])
	}
	// qcowfs info shows the backing file as qemu-img info does.
	r := harness.Run(t, "info", o)
	harness.WantOK(t, "qcowfs info "+o, r)
	out := r.Stdout
	in := qemu.Info(t, o)
	for _, want := range []string{fmt.Sprintf("backing file: %s\n", in["backing-filename"]), fmt.Sprintf("backing file format: %s\n", in["backing-filename-format"])} {
		if !strings.Contains(out, want) {
			t.Errorf("qcowfs info of the overlay lacks %q:\n%s", want, out)
		}
	}
	if temps, _ := filepath.Glob(filepath.Join(ov, ".c.qcow2.tmp-*")); len(temps) != 0 {
		t.Errorf("the crashed creation's temporary file is still there: %v", temps)
	}
}

// TestOverlayGuestCommit: an ext4 in the second partition of a GPT disk,
// edited through an overlay (vm.raw.parts/p2 on a loop device, files
// written); the original is unchanged; then qemu-img commit of the
// overlay, and a read-only mount of the original reads every file back.
func TestOverlayGuestCommit(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "sfdisk", "mkfs.ext4", "losetup", "mount")
	work := t.TempDir()
	src := qemu.TempDir(t)
	const partSize = 48 << 20
	disk := makeTwoPartDisk(t, work, partSize)
	qemu.Run(t, "mkfs.ext4", "-q", "-F", "-E", "offset=2097152", disk, fmt.Sprint(partSize>>10))
	img := filepath.Join(src, "vm.qcow2")
	qemu.Img(t, "convert", "-q", "-f", "raw", "-O", "qcow2", disk, img)
	before := harness.ReadTree(t, src)
	ov := t.TempDir()

	m := harness.Mount(t, src, "--writable", "--overlay", ov)
	dev, detach := harness.AttachLoop(t, filepath.Join(m.Dir, "vm.raw.parts", "p2"))
	dir, umount := harness.MountGuest(t, dev, "")
	want := writeFiles(t, dir, 60, 7)
	umount()
	detach()
	m.Unmount(t)
	harness.CompareTrees(t, harness.ReadTree(t, src), before) // the source is untouched
	qemu.CheckClean(t, filepath.Join(ov, "vm.qcow2"))

	qemu.Img(t, "commit", "-q", filepath.Join(ov, "vm.qcow2"))
	qemu.CheckClean(t, img)
	m = harness.Mount(t, src)
	dev, _ = harness.AttachLoop(t, filepath.Join(m.Dir, "vm.raw.parts", "p2"), "-r")
	ro, _ := harness.MountGuest(t, dev, "ro,noload")
	harness.CompareTrees(t, harness.ReadTree(t, ro), want) // after qemu-img commit
}

// TestTempOverlay: throwaway overlays (--writable --overlay=temp) over a
// local folder, without --cache-dir. qcowfs status names the mount's
// folder of overlays, under $TMPDIR/qcowfs-UID; seeded writes, discards
// and a grow read back as the raw model while the mount lasts, and the
// overlay in that folder is what qemu reads as the model (qemu-img compare
// -U after fsync); the source is unchanged. The folder is gone once qcowfs
// unmount returns, and once a daemon stopped with SIGTERM has exited. A
// daemon killed with SIGKILL leaves its folder; the next mount with
// --overlay=temp removes it (and its own after unmount), so folders never
// pile up.
func TestTempOverlay(t *testing.T) {
	src := harness.SourceDir(t)
	img := filepath.Join(src, "vm.qcow2")
	qemu.Create(t, "qcow2", img, "32M")
	qemu.Run(t, "qemu-io", "-c", "write -P 0x5a 1M 3M", img)
	before := harness.ReadTree(t, src)
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp) // the daemons' and qcowfs unmount's
	root := filepath.Join(tmp, fmt.Sprintf("qcowfs-%d", os.Geteuid()))
	work := qemu.TempDir(t)
	model, err := os.ReadFile(qemu.ToRaw(t, img, filepath.Join(work, "before.raw")))
	if err != nil {
		t.Fatal(err)
	}

	// folderOf is m's folder of throwaway overlays, from qcowfs status.
	folderOf := func(m *harness.Mounted) string {
		t.Helper()
		st, out := harness.StatusOf(t, m.Dir)
		if !st.TempOverlay || filepath.Dir(st.Overlay) != root {
			t.Fatalf("qcowfs status of a mount with --overlay=temp: overlay %q, temp %v; want a throwaway folder in %s\n%s", st.Overlay, st.TempOverlay, root, out)
		}
		if fi, err := os.Stat(st.Overlay); err != nil || fi.Mode().Perm() != 0o700 {
			t.Fatalf("the folder of throwaway overlays %s: %v; want mode 0700", st.Overlay, err)
		}
		return st.Overlay
	}
	// write applies seeded operations through m and checks they read
	// back, then that qemu reads the overlay in dir as the model.
	write := func(m *harness.Mounted, dir, round string) {
		t.Helper()
		f := harness.OpenFile(t, filepath.Join(m.Dir, "vm.raw"), os.O_RDWR)
		h := fnv.New64a()
		h.Write([]byte(round))
		for _, op := range qemu.Ops(h.Sum64(), 20, int64(len(model)), 64<<10) {
			applyThrough(t, f, op)
			model = op.Apply(model)
		}
		if err := f.Sync(); err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(filepath.Join(m.Dir, "vm.raw"))
		if err != nil {
			t.Fatal(err)
		}
		if i := harness.FirstDiff(got, model); i >= 0 {
			t.Errorf("%s: the mount reads differently from the model at byte %d", round, i)
		}
		f.Close()
		want := filepath.Join(work, round+".raw")
		if err := os.WriteFile(want, model, 0o644); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command("qemu-img", "compare", "-U", "-f", "qcow2", "-F", "raw", filepath.Join(dir, "vm.qcow2"), want).CombinedOutput(); err != nil {
			t.Errorf("%s: qemu-img compare of the throwaway overlay with the model: %v\n%s", round, err, out)
		}
	}
	gone := func(dir, when string) {
		t.Helper()
		if _, err := os.Lstat(dir); !os.IsNotExist(err) {
			t.Errorf("%s: the folder of throwaway overlays %s is still there (%v)", when, dir, err)
		}
	}
	fresh := func() {
		// Each mount starts from the original: throwaway writes are
		// gone with their mount.
		var err error
		if model, err = os.ReadFile(filepath.Join(work, "before.raw")); err != nil {
			t.Fatal(err)
		}
	}

	m := harness.Racy.Mount(t, src, "--writable", "--overlay=temp")
	dir := folderOf(m)
	write(m, dir, "unmount")
	m.Unmount(t)
	gone(dir, "after qcowfs unmount")
	harness.CompareTrees(t, harness.ReadTree(t, src), before)

	fresh()
	m = harness.Mount(t, src, "--writable", "--overlay=temp")
	if got, err := os.ReadFile(filepath.Join(m.Dir, "vm.raw")); err != nil || harness.FirstDiff(got, model) >= 0 {
		t.Errorf("a new mount with --overlay=temp does not read as the original (%v)", err)
	}
	dir = folderOf(m)
	write(m, dir, "sigterm")
	if err := syscall.Kill(m.PID(t), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	harness.WaitGone(t, m.Dir)
	gone(dir, "after SIGTERM")

	fresh()
	m = harness.Mount(t, src, "--writable", "--overlay=temp")
	killed := folderOf(m)
	write(m, killed, "sigkill")
	if err := syscall.Kill(m.PID(t), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	harness.WaitGone(t, m.Dir)
	exec.Command("umount", "-l", m.Dir).Run()
	if _, err := os.Stat(filepath.Join(killed, "vm.qcow2")); err != nil {
		t.Errorf("a daemon killed with SIGKILL removed its overlays? %v", err)
	}
	m = harness.Mount(t, src, "--writable", "--overlay=temp")
	gone(killed, "after the next mount")
	dir = folderOf(m)
	if names, _ := filepath.Glob(filepath.Join(root, "*")); len(names) != 1 || names[0] != dir {
		t.Errorf("throwaway folders beside the live mount's %s: %v", dir, names)
	}
	m.Unmount(t)
	gone(dir, "after qcowfs unmount")
	harness.CompareTrees(t, harness.ReadTree(t, src), before)
}
