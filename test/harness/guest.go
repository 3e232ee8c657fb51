package harness

// Guest disks: a GPT disk with an ext4 file system made from a tree of
// files, loop devices over the files a mount shows, the guest file system
// mounted from them and read back.

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/qemu"
)

// The guest disk's layout: a GPT disk with one Linux partition at 1 MiB,
// the usual alignment, and room after it for the backup GPT.
const (
	guestDiskSize = 80 << 20
	guestPartOff  = 1 << 20
	guestPartSize = 64 << 20
)

// A TreeEntry is what a test knows about one file or folder of a guest
// tree; sum is a regular file's sha256, in hex.
type TreeEntry struct {
	Dir  bool
	Size int64
	Sum  string
}

func (e TreeEntry) String() string {
	if e.Dir {
		return "folder"
	}
	return fmt.Sprintf("%d bytes, sha256 %s", e.Size, e.Sum)
}

// WriteGuestTree fills dir with the files the guest disk will hold and
// returns what it wrote, keyed by slash-separated path relative to dir.
// Sizes are chosen to give ext4 every kind of file: empty, inline-sized,
// a few blocks, not a multiple of the block size, several MiB in extents,
// and files with zero runs, which mkfs.ext4 -d leaves as holes.
func WriteGuestTree(t testing.TB, dir string) map[string]TreeEntry {
	t.Helper()
	tree := map[string]TreeEntry{}
	// Seeded, so a failure can be reproduced with the same bytes.
	rng := rand.NewChaCha8([32]byte{'q', 'c', 'o', 'w', 'f', 's'})
	random := func(n int) []byte {
		b := make([]byte, n)
		rng.Read(b)
		return b
	}
	mkdir := func(name string) {
		if err := os.MkdirAll(filepath.Join(dir, name), 0o755); err != nil {
			t.Fatal(err)
		}
		// MkdirAll makes parents too; record every one of them.
		for p := name; p != "."; p = filepath.Dir(p) {
			tree[filepath.ToSlash(p)] = TreeEntry{Dir: true}
		}
	}
	write := func(name string, data []byte) {
		mkdir(filepath.Dir(name))
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(data)
		tree[filepath.ToSlash(name)] = TreeEntry{Size: int64(len(data)), Sum: hex.EncodeToString(sum[:])}
	}

	write("README.txt", []byte("A guest disk made by qcowfs's loop-mount test.\n"))
	write("etc/hostname", []byte("guest\n"))
	write("etc/fstab", []byte("/dev/vda1 / ext4 defaults 0 1\n"))
	write("empty", nil)
	for i := range 24 {
		// Text of sizes from a few bytes to a few blocks.
		line := fmt.Sprintf("note %d: the quick brown fox jumps over the lazy dog\n", i)
		write(fmt.Sprintf("notes/note-%02d.txt", i), []byte(strings.Repeat(line, 1+i*i*3)))
	}
	write("data/blob-1M", random(1<<20))
	write("data/blob-3M-odd", random(3<<20+1234))
	write("data/blob-2M-less-1", random(2<<20-1))
	write("data/odd-size.bin", random(5*4096+17))
	var holes []byte
	holes = append(holes, random(4096)...)
	holes = append(holes, make([]byte, 1<<20)...)
	holes = append(holes, random(3000)...)
	holes = append(holes, make([]byte, 300<<10)...)
	holes = append(holes, random(1)...)
	write("data/holes.bin", holes)
	write("data/zeros", make([]byte, 256<<10))
	write("a/b/c/deep.txt", []byte("three folders down\n"))
	write("a/b/c/d/deeper.bin", random(70000))
	mkdir("empty-folder")
	return tree
}

// MakeGuestDisk makes a raw GPT disk in work whose one partition holds an
// ext4 file system populated from tree, and returns the disk's path. No
// mount is needed: mkfs.ext4 -d fills the file system from a folder.
func MakeGuestDisk(t testing.TB, work, tree string) string {
	t.Helper()
	part := filepath.Join(work, "part.img")
	qemu.Run(t, "mkfs.ext4", "-q", "-F", "-d", tree, part, strconv.Itoa(guestPartSize>>10)+"k")

	disk := filepath.Join(work, "disk.img")
	f, err := os.Create(disk)
	if err != nil {
		t.Fatal(err)
	}
	err = f.Truncate(guestDiskSize)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatal(err)
	}
	Partition(t, disk, fmt.Sprintf("label: gpt\nstart=%dKiB, size=%dKiB, type=linux\n", guestPartOff>>10, guestPartSize>>10))

	// Copy to where sfdisk says the partition is, and make sure that is
	// where we asked for it: the check after mounting relies on it.
	var table struct {
		PartitionTable struct {
			SectorSize int `json:"sectorsize"`
			Partitions []struct {
				Start int64 `json:"start"`
				Size  int64 `json:"size"`
			} `json:"partitions"`
		} `json:"partitiontable"`
	}
	if err := json.Unmarshal(qemu.Run(t, "sfdisk", "--json", disk), &table); err != nil {
		t.Fatalf("sfdisk --json %s: %v", disk, err)
	}
	pt := table.PartitionTable
	if len(pt.Partitions) != 1 || pt.SectorSize != 512 ||
		pt.Partitions[0].Start*512 != guestPartOff || pt.Partitions[0].Size*512 != guestPartSize {
		t.Fatalf("sfdisk made %+v, want one partition of %d bytes at %d", pt, guestPartSize, guestPartOff)
	}
	qemu.Run(t, "dd", "if="+part, "of="+disk, "bs=1M", "oflag=seek_bytes",
		"seek="+strconv.Itoa(guestPartOff), "conv=notrunc", "status=none")
	return disk
}

// Partition writes a partition table on disk (a file) with sfdisk, table
// being sfdisk's input ("label: gpt\nsize=4MiB\n...").
func Partition(t testing.TB, disk, table string) {
	t.Helper()
	sfdisk := exec.Command("sfdisk", "-q", disk)
	sfdisk.Stdin = strings.NewReader(table)
	WantOK(t, "sfdisk "+disk, RunCmd(t, sfdisk))
}

// Fsck checks the ext4 file system on dev (a device or a file) with
// e2fsck -fn, which must find it clean.
func Fsck(t testing.TB, dev string) {
	t.Helper()
	if r := Exec(t, "e2fsck", "-fn", dev); r.Code != 0 {
		t.Errorf("e2fsck -fn %s: exit status %d\n%s%s", dev, r.Code, r.Stdout, r.Stderr)
	}
}

// AttachLoop attaches file to a free loop device with losetup's flags
// (-r read-only, -P with partition scanning) and detaches it when the
// test ends, or before when detach is called.
func AttachLoop(t testing.TB, file string, flags ...string) (dev string, detach func()) {
	t.Helper()
	dev = strings.TrimSpace(string(qemu.Run(t, "losetup", append(append(flags, "-f", "--show"), file)...)))
	if !strings.HasPrefix(dev, "/dev/loop") {
		t.Fatalf("losetup attached %s to %q, not a loop device", file, dev)
	}
	done := false
	detach = func() {
		if !done {
			done = true
			if out, err := exec.Command("losetup", "-d", dev).CombinedOutput(); err != nil {
				t.Errorf("losetup -d %s: %v %s", dev, err, out)
			}
		}
	}
	t.Cleanup(detach)
	if slices.Contains(flags, "-r") {
		if ro := sysfsText(t, filepath.Join("/sys/block", filepath.Base(dev), "ro")); ro != "1" {
			t.Fatalf("%s is not read-only (ro=%s)", dev, ro)
		}
	}
	return dev, detach
}

// PartitionNode returns the device node of the first partition of the
// loop device dev. A kernel with a GPT parser has made it during losetup
// -P; a kernel without one has not, and partx then reads the table in user
// space and tells the kernel about the partition. Either way the node
// itself appears asynchronously, made by devtmpfs (and udev, if running).
func PartitionNode(t testing.TB, dev string) string {
	t.Helper()
	name := filepath.Base(dev) + "p1"
	sys := filepath.Join("/sys/block", filepath.Base(dev), name)
	if _, err := os.Stat(sys); err != nil {
		// Remove what partx adds even if partx fails half way;
		// losetup -d would not remove partitions it did not make.
		t.Cleanup(func() { exec.Command("partx", "-d", dev).Run() })
		qemu.Run(t, "partx", "-a", dev)
	}
	if _, err := exec.LookPath("udevadm"); err == nil {
		exec.Command("udevadm", "settle").Run()
	}
	node := filepath.Join("/dev", name)
	WaitFor(t, node, 10*time.Second, func() bool {
		st, err := os.Stat(node)
		return err == nil && st.Mode()&fs.ModeDevice != 0
	})

	// The kernel's idea of the partition must be the one we made.
	start := sysfsText(t, filepath.Join(sys, "start"))
	size := sysfsText(t, filepath.Join(sys, "size"))
	if start != strconv.Itoa(guestPartOff/512) || size != strconv.Itoa(guestPartSize/512) {
		t.Fatalf("%s: start %s size %s sectors, want %d and %d", node, start, size, guestPartOff/512, guestPartSize/512)
	}
	return node
}

// MountGuest mounts the ext4 file system on dev with options opts ("" for
// read-write; "ro,noload" read-only, without the journal, which a
// read-only device could not replay anyway) and unmounts it when the test
// ends, or before when unmount is called.
func MountGuest(t testing.TB, dev, opts string) (dir string, unmount func()) {
	t.Helper()
	dir = t.TempDir()
	args := []string{"-t", "ext4", dev, dir}
	if opts != "" {
		args = append([]string{"-o", opts}, args...)
	}
	qemu.Run(t, "mount", args...)
	done := false
	unmount = func() {
		if !done {
			done = true
			if out, err := exec.Command("umount", dir).CombinedOutput(); err != nil {
				// Detach lazily so the mount cannot outlive the test;
				// the loop device is then freed on last close.
				t.Errorf("umount %s: %v %s; detaching", dir, err, out)
				exec.Command("umount", "-l", dir).Run()
			}
		}
	}
	t.Cleanup(unmount)
	return dir, unmount
}

// ReadTree walks the folder root (a mounted guest file system, a source
// folder) and returns what it finds, the way WriteGuestTree describes what
// it wrote. lost+found is mkfs's, not ours.
func ReadTree(t testing.TB, root string) map[string]TreeEntry {
	t.Helper()
	tree := map[string]TreeEntry{}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, path)
		if err != nil {
			return err
		}
		switch {
		case rel == ".":
			return nil
		case rel == "lost+found":
			return fs.SkipDir
		case d.IsDir():
			tree[filepath.ToSlash(rel)] = TreeEntry{Dir: true}
			return nil
		case !d.Type().IsRegular():
			return fmt.Errorf("%s: unexpected file type %v", rel, d.Type())
		}
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		defer f.Close()
		st, err := f.Stat()
		if err != nil {
			return err
		}
		h := sha256.New()
		n, err := io.Copy(h, f)
		if err != nil {
			return fmt.Errorf("reading %s: %w", rel, err)
		}
		if n != st.Size() {
			return fmt.Errorf("%s: read %d bytes, stat says %d", rel, n, st.Size())
		}
		tree[filepath.ToSlash(rel)] = TreeEntry{Size: n, Sum: hex.EncodeToString(h.Sum(nil))}
		return nil
	})
	if err != nil {
		t.Fatalf("walking %s: %v", root, err)
	}
	return tree
}

// CompareTrees reports every path missing, extra or different in got
// (ReadTree) as compared with want.
func CompareTrees(t testing.TB, got, want map[string]TreeEntry) {
	t.Helper()
	var paths []string
	for p := range want {
		paths = append(paths, p)
	}
	for p := range got {
		if _, ok := want[p]; !ok {
			paths = append(paths, p)
		}
	}
	slices.Sort(paths)
	for _, p := range paths {
		g, inGot := got[p]
		w, inWant := want[p]
		switch {
		case !inGot:
			t.Errorf("%s: missing (want %v)", p, w)
		case !inWant:
			t.Errorf("%s: there but never put there (%v)", p, g)
		case g != w:
			t.Errorf("%s: got %v, want %v", p, g, w)
		}
	}
}

// sysfsText reads a one-line sysfs attribute.
func sysfsText(t testing.TB, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}
