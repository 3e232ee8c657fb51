package test

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/qcowfs/qcowfs/test/qemu"
)

// Overlay mode (--writable --overlay DIR): the originals are never
// written; the first write to an image makes DIR/REL, a qcow2 with the
// original as backing file. qemu is the oracle: qemu-img check and info of
// the overlays, qemu-img convert of them against a raw model.

// treeSums returns the sha256 of every regular file under dir, by path.
func treeSums(t *testing.T, dir string) map[string][32]byte {
	t.Helper()
	sums := map[string][32]byte{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		sums[p] = fileSHA(t, p)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return sums
}

func sameTree(t *testing.T, dir string, want map[string][32]byte) {
	t.Helper()
	got := treeSums(t, dir)
	for p, s := range want {
		if got[p] != s {
			t.Errorf("%s changed in overlay mode", p)
		}
	}
	for p := range got {
		if _, ok := want[p]; !ok {
			t.Errorf("%s appeared in the source in overlay mode", p)
		}
	}
}

// imgInfo is what qemu-img info --output=json says of an overlay.
type imgInfo struct {
	VirtualSize    int64  `json:"virtual-size"`
	ClusterSize    int64  `json:"cluster-size"`
	Format         string `json:"format"`
	BackingFile    string `json:"backing-filename"`
	BackingFormat  string `json:"backing-filename-format"`
	FullBackingRef string `json:"full-backing-filename"`
}

func qemuInfo(t *testing.T, path string) imgInfo {
	t.Helper()
	out, err := exec.Command("qemu-img", "info", "--output=json", path).Output()
	var in imgInfo
	if err == nil {
		err = json.Unmarshal(out, &in)
	}
	if err != nil {
		t.Fatalf("qemu-img info %s: %v", path, err)
	}
	return in
}

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
	requireFUSE(t)
	src := qemu.TempDir(t)
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
	before := treeSums(t, src)

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
	apply := func(m *mount, round string, n int) {
		for _, s := range all {
			f, err := os.OpenFile(filepath.Join(m.Dir, s.im.Name+".raw"), os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
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
			if i := firstDiff(got, s.model); i >= 0 {
				t.Errorf("%s: the mount reads differently from the model at byte %d (lengths %d, %d)", s.im.Name, i, len(got), len(s.model))
			}
		}
	}
	logMount = nil

	m := mountImages(t, src, "--writable", "--overlay", ov, racyMount)
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
	m.unmount(t)

	sameTree(t, src, before)
	if _, err := os.Lstat(filepath.Join(ov, "only-read.qcow2")); !os.IsNotExist(err) {
		t.Errorf("an image never written has an overlay (%v)", err)
	}
	inodes := map[string]os.FileInfo{}
	check := func(t *testing.T, s *state) string {
		t.Helper()
		o := filepath.Join(ov, s.im.Name+".qcow2")
		qemuCheckClean(t, o)
		in := qemuInfo(t, o)
		orig := filepath.Join(realSrc, s.im.Name+".qcow2")
		if in.Format != "qcow2" || in.BackingFile != orig || in.BackingFormat != "qcow2" || in.ClusterSize != s.im.ClusterSize || in.VirtualSize != int64(len(s.model)) {
			t.Errorf("qemu-img info of the overlay: %+v; want backing file %s, format qcow2, cluster size %d, size %d", in, orig, s.im.ClusterSize, len(s.model))
		}
		got, err := os.ReadFile(qemu.ToRaw(t, o, filepath.Join(work, strings.ReplaceAll(s.im.Name, "/", "_")+".after")))
		if err != nil {
			t.Fatal(err)
		}
		if i := firstDiff(got, s.model); i >= 0 {
			t.Errorf("qemu-img convert of the overlay differs from the model at byte %d", i)
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
	m = mountImages(t, src, "--writable", "--overlay", ov, racyMount)
	for _, s := range all {
		got, err := os.ReadFile(filepath.Join(m.Dir, s.im.Name+".raw"))
		if err != nil {
			t.Fatal(err)
		}
		if i := firstDiff(got, s.model); i >= 0 {
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
	m.unmount(t)
	sameTree(t, src, before)
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
	m = mountImages(t, src, "--writable", "--overlay", ov)
	sameFile(t, filepath.Join(m.Dir, s.im.Name+".raw"), filepath.Join(work, s.im.Name+".before"))
	m.unmount(t)
}

// TestOverlayRules: --overlay needs --writable, and a folder outside the
// source and the mount point (one-line errors, exit status, nothing
// mounted); plain files stay read-only; an overlay that names another
// backing file is refused with a message naming both, while the mount's
// other images work.
func TestOverlayRules(t *testing.T) {
	requireFUSE(t)
	src := qemu.TempDir(t)
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
		out, err := qcowfs(append(append([]string{"mount"}, c.args...), src, mnt)...)
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		}
		if code != c.code || !strings.Contains(out, c.want) || strings.Count(strings.TrimSpace(out), "\n") > 1 {
			t.Errorf("qcowfs mount %v: exit %d, %q; want exit %d and a line saying %q", c.args, code, out, c.code, c.want)
		}
		if isMounted(mnt) {
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
	m := mountImages(t, src, "--writable", "--overlay", ov, "--allow-backing-outside", filepath.Dir(other))
	if _, err := os.ReadFile(filepath.Join(m.Dir, "a.raw")); err == nil {
		t.Errorf("a.raw readable through an overlay that names %s as its backing file", other)
	}
	if err := os.WriteFile(filepath.Join(m.Dir, "b.raw"), []byte("b"), 0); err == nil {
		t.Errorf("b.raw written with O_TRUNC")
	}
	f, err := os.OpenFile(filepath.Join(m.Dir, "b.raw"), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("b"), 0); err != nil {
		t.Errorf("b.raw beside a refused overlay: %v", err)
	}
	f.Close()
	if _, err := os.OpenFile(filepath.Join(m.Dir, "notes.txt"), os.O_WRONLY, 0); err == nil {
		t.Errorf("a plain file opened for writing in overlay mode")
	}
	m.unmount(t)
	log := m.logText(t)
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
	requireFUSE(t)
	src := qemu.TempDir(t)
	img := filepath.Join(src, "c.qcow2")
	qemu.Create(t, "qcow2", img, "16M")
	qemu.Run(t, "qemu-io", "-c", "write -P 0x33 0 2M", img)
	before := treeSums(t, src)
	ov := t.TempDir()

	t.Setenv("QCOWFS_TEST_KILL_AT", "overlay-prepared")
	m := mountImages(t, src, "--writable", "--overlay", ov)
	f, err := os.OpenFile(filepath.Join(m.Dir, "c.raw"), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
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
	sameTree(t, src, before)

	os.Unsetenv("QCOWFS_TEST_KILL_AT")
	m = mountImages(t, src, "--writable", "--overlay", ov)
	f, err = os.OpenFile(filepath.Join(m.Dir, "c.raw"), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("kept"), 4096); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	m.unmount(t)
	sameTree(t, src, before)
	o := filepath.Join(ov, "c.qcow2")
	qemuCheckClean(t, o)
	raw, err := os.ReadFile(qemu.ToRaw(t, o, filepath.Join(t.TempDir(), "c.raw")))
	if err != nil {
		t.Fatal(err)
	}
	if string(raw[4096:4100]) != "kept" || raw[0] != 0x33 || raw[2<<20] != 0 {
		t.Errorf("the overlay made after the crash reads %q at 4096, %#x at 0", raw[4096:4100], raw[0])
	}
	// qcowfs info shows the backing file as qemu-img info does.
	out, err := qcowfs("info", o)
	if err != nil {
		t.Fatalf("qcowfs info %s: %v\n%s", o, err, out)
	}
	in := qemuInfo(t, o)
	for _, want := range []string{"backing file: " + in.BackingFile + "\n", "backing file format: " + in.BackingFormat + "\n"} {
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
	requireFUSE(t)
	qemu.Require(t, "sfdisk", "mkfs.ext4", "losetup", "mount")
	work := t.TempDir()
	src := qemu.TempDir(t)
	const partSize = 48 << 20
	disk := makeTwoPartDisk(t, work, partSize)
	qemu.Run(t, "mkfs.ext4", "-q", "-F", "-E", "offset=2097152", disk, fmt.Sprint(partSize>>10))
	img := filepath.Join(src, "vm.qcow2")
	qemu.Img(t, "convert", "-q", "-f", "raw", "-O", "qcow2", disk, img)
	before := treeSums(t, src)
	ov := t.TempDir()

	m := mountImages(t, src, "--writable", "--overlay", ov)
	dev, detach := attachLoopRW(t, filepath.Join(m.Dir, "vm.raw.parts", "p2"))
	dir, umount := mountRW(t, dev)
	sums := writeFiles(t, dir, 60, 7)
	umount()
	detach()
	m.unmount(t)
	sameTree(t, src, before)
	qemuCheckClean(t, filepath.Join(ov, "vm.qcow2"))

	qemu.Img(t, "commit", "-q", filepath.Join(ov, "vm.qcow2"))
	qemuCheckClean(t, img)
	m = mountImages(t, src)
	dev = strings.TrimSpace(string(qemu.Run(t, "losetup", "-r", "-f", "--show", filepath.Join(m.Dir, "vm.raw.parts", "p2"))))
	defer exec.Command("losetup", "-d", dev).Run()
	ro := t.TempDir()
	qemu.Run(t, "mount", "-t", "ext4", "-o", "ro,noload", dev, ro)
	defer exec.Command("umount", ro).Run()
	for name, want := range sums {
		b, err := os.ReadFile(filepath.Join(ro, name))
		if err != nil {
			t.Fatal(err)
		}
		s := sha256.Sum256(b)
		if hex.EncodeToString(s[:]) != want {
			t.Errorf("%s after qemu-img commit: sha256 %x, want %s", name, s, want)
		}
	}
}
