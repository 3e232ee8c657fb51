package read

// Guest disks: the partition files of GPT and MBR disks, a damaged or
// rewritten table; a guest partition loop-mounted from a disk file.

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// sfdiskTable is what `sfdisk --json` says of a disk: the oracle for where
// the partitions are.
type sfdiskTable struct {
	PartitionTable struct {
		Label      string `json:"label"`
		Partitions []struct {
			Node  string `json:"node"`
			Start int64  `json:"start"`
			Size  int64  `json:"size"`
			Type  string `json:"type"`
		} `json:"partitions"`
	} `json:"partitiontable"`
}

// sfdiskParts returns partition number -> [start, size) in bytes, numbered
// from sfdisk's device names (disk1, disk5, ...), skipping extended
// containers.
func sfdiskParts(t *testing.T, disk string) map[int][2]int64 {
	t.Helper()
	var st sfdiskTable
	if err := json.Unmarshal(qemu.Run(t, "sfdisk", "--json", disk), &st); err != nil {
		t.Fatal(err)
	}
	out := map[int][2]int64{}
	for _, p := range st.PartitionTable.Partitions {
		var n int
		fmt.Sscanf(p.Node[len(disk):], "%d", &n)
		if p.Type == "5" || p.Type == "f" || p.Type == "85" {
			continue // extended containers get no file
		}
		out[n] = [2]int64{p.Start * 512, p.Size * 512}
	}
	return out
}

// makeMBRDisk makes a raw MBR disk: a FAT primary partition, an extended
// partition holding two logical partitions (ext4 made from tree, and
// another FAT).
func makeMBRDisk(t *testing.T, work, tree string) string {
	t.Helper()
	disk := filepath.Join(work, "mbr.img")
	qemu.Run(t, "truncate", "-s", "96M", disk)
	// After an extended partition that fills the disk, sfdisk makes the
	// following lines logical partitions (5, 6).
	harness.Partition(t, disk, "label: dos\n,16MiB,c\n,,E\n,48MiB,L\n,20MiB,c\n")
	parts := sfdiskParts(t, disk)
	fill := func(n int, mkfs ...string) {
		img := filepath.Join(work, fmt.Sprintf("p%d.img", n))
		qemu.Run(t, "truncate", "-s", fmt.Sprint(parts[n][1]), img)
		qemu.Run(t, mkfs[0], append(mkfs[1:], img)...)
		qemu.Run(t, "dd", "if="+img, "of="+disk, "bs=1M", "oflag=seek_bytes", fmt.Sprintf("seek=%d", parts[n][0]), "conv=notrunc", "status=none")
	}
	fill(1, "mkfs.vfat", "-n", "ONE")
	fill(5, "mkfs.ext4", "-q", "-F", "-d", tree)
	fill(6, "mkfs.vfat", "-n", "SIX")
	return disk
}

// clipRuns shifts the disk's data runs into a partition's frame.
func clipRuns(runs [][2]int64, start, size int64) [][2]int64 {
	var out [][2]int64
	for _, r := range runs {
		a, b := max(r[0], start), min(r[1], start+size)
		if a < b {
			out = append(out, [2]int64{a - start, b - start})
		}
	}
	return out
}

// TestPartitionFiles: GPT and MBR (with logical partitions) guest disks,
// as qcow2 and compressed qcow2, show STEM.raw.parts/pN files that are
// exactly the partitions sfdisk sees in qemu-img convert's output, with
// the disk's holes and st_blocks; the ext4 partition mounts with mount -o
// loop,ro and every file's sha256 matches; debugfs reads it as an
// unprivileged user; --no-partitions hides the folders.
func TestPartitionFiles(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "sfdisk", "mkfs.ext4", "mkfs.vfat", "debugfs", "setpriv", "mount")
	work := qemu.TempDir(t)
	tree := filepath.Join(work, "tree")
	want := harness.WriteGuestTree(t, tree)
	gpt := harness.MakeGuestDisk(t, work, tree)
	mbr := makeMBRDisk(t, work, tree)

	src := qemu.TempDir(t)
	disks := map[string]string{}
	for _, d := range []struct{ name, raw string }{{"gpt", gpt}, {"mbr", mbr}} {
		for _, v := range []struct {
			suffix string
			opts   []string
		}{{"", nil}, {"-compressed", []string{"-c"}}} {
			name := d.name + v.suffix
			p := filepath.Join(src, name+".qcow2")
			qemu.Img(t, append(append([]string{"convert", "-q", "-f", "raw", "-O", "qcow2"}, v.opts...), d.raw, p)...)
			disks[name] = d.raw
		}
	}
	m := harness.Mount(t, src, "--allow-other")
	// nobody must be able to reach the mount point (t.TempDir makes its
	// folders 0700).
	for d := filepath.Dir(m.Dir); d != "/" && d != os.TempDir(); d = filepath.Dir(d) {
		os.Chmod(d, 0o755)
	}
	for name, raw := range disks {
		t.Run(name, func(t *testing.T) {
			parts := sfdiskParts(t, raw)
			dir := filepath.Join(m.Dir, name+".raw.parts")
			var wantNames []string
			for n := range parts {
				wantNames = append(wantNames, fmt.Sprintf("p%d", n))
			}
			slices.Sort(wantNames)
			if got := harness.Names(t, dir); !slices.Equal(got, wantNames) {
				t.Fatalf("%s lists %q, sfdisk sees %q", dir, got, wantNames)
			}
			qraw := qemu.RawBytes(t, filepath.Join(src, name+".qcow2"))
			diskFile, _ := os.Open(filepath.Join(m.Dir, name+".raw"))
			defer diskFile.Close()
			diskRuns := harness.SeekRuns(t, diskFile, int64(len(qraw)))
			for n, r := range parts {
				p := filepath.Join(dir, fmt.Sprintf("p%d", n))
				got, err := os.ReadFile(p)
				if err != nil || !bytes.Equal(got, qraw[r[0]:r[0]+r[1]]) {
					t.Errorf("p%d: %v, or its bytes differ from the disk's range [%d, +%d)", n, err, r[0], r[1])
				}
				if runs := harness.FileRuns(t, p); !slices.Equal(runs, clipRuns(diskRuns, r[0], r[1])) {
					t.Errorf("p%d: holes %v differ from the disk's in that range %v", n, runs, clipRuns(diskRuns, r[0], r[1]))
				}
				var data int64
				for _, x := range clipRuns(diskRuns, r[0], r[1]) {
					data += x[1] - x[0]
				}
				harness.WaitFor(t, fmt.Sprintf("st_blocks of p%d", n), 10*time.Second, func() bool {
					var st unix.Stat_t
					unix.Stat(p, &st)
					return st.Blocks == (data+511)/512
				})
			}
			// The ext4 partition through a loop device, and through
			// debugfs run by nobody.
			ext4 := filepath.Join(dir, "p1")
			if strings.HasPrefix(name, "mbr") {
				ext4 = filepath.Join(dir, "p5")
			}
			guest := t.TempDir()
			qemu.Run(t, "mount", "-t", "ext4", "-o", "loop,ro,noload", ext4, guest)
			t.Cleanup(func() {
				if r := harness.Exec(t, "umount", guest); r.Code != 0 {
					t.Errorf("umount: exit status %d %s", r.Code, r.Stderr)
					harness.Exec(t, "umount", "-l", guest)
				}
			})
			harness.CompareTrees(t, harness.ReadTree(t, guest), want)
			for path, e := range want {
				if e.Sum == "" {
					continue
				}
				r := harness.Exec(t, "setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
					"debugfs", "-R", "cat /"+path, ext4)
				sum := sha256.Sum256([]byte(r.Stdout))
				if r.Code != 0 || hex.EncodeToString(sum[:]) != e.Sum {
					t.Errorf("debugfs as nobody, cat /%s: exit status %d, sha256 %x, want %s\n%s", path, r.Code, sum, e.Sum, r.Stderr)
				}
				break // one file is enough to show unprivileged access
			}
		})
	}

	off := harness.Mount(t, src, "--no-partitions")
	for _, n := range harness.Names(t, off.Dir) {
		if strings.HasSuffix(n, ".parts") {
			t.Errorf("--no-partitions still shows %s", n)
		}
	}
}

// TestPartitionDamage: a GPT whose primary header is damaged is read from
// its backup (with a warning); an MBR partition running past the end of
// the disk is refused with a log line while the others and the whole disk
// are still served.
func TestPartitionDamage(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "sfdisk")
	work := qemu.TempDir(t)
	src := qemu.TempDir(t)

	gpt := filepath.Join(work, "gpt.img")
	qemu.Run(t, "truncate", "-s", "16M", gpt)
	harness.Partition(t, gpt, "label: gpt\nsize=4MiB\nsize=4MiB\n")
	want := sfdiskParts(t, gpt)
	qemu.WriteAt(t, gpt, 512, bytes.Repeat([]byte{0xee}, 92)) // the primary GPT header
	qemu.Img(t, "convert", "-q", "-f", "raw", "-O", "qcow2", gpt, filepath.Join(src, "gpt.qcow2"))

	mbr := filepath.Join(work, "mbr.img")
	qemu.Run(t, "truncate", "-s", "16M", mbr)
	harness.Partition(t, mbr, "label: dos\nsize=4MiB, type=83\nsize=4MiB, type=83\n")
	// Partition 2's size field (entry 2 at 446+16, size at +12): 1 GiB.
	binary32 := []byte{0, 0, 0x20, 0}
	qemu.WriteAt(t, mbr, 446+16+12, binary32)
	qemu.Img(t, "convert", "-q", "-f", "raw", "-O", "qcow2", mbr, filepath.Join(src, "mbr.qcow2"))

	m := harness.Mount(t, src)
	if got := harness.Names(t, filepath.Join(m.Dir, "gpt.raw.parts")); !slices.Equal(got, []string{"p1", "p2"}) {
		t.Errorf("damaged primary GPT: lists %q, want p1 and p2 from the backup", got)
	}
	for n, r := range want {
		st, err := os.Stat(filepath.Join(m.Dir, "gpt.raw.parts", fmt.Sprintf("p%d", n)))
		if err != nil || st.Size() != r[1] {
			t.Errorf("gpt p%d: %v, size %v; sfdisk made it %d bytes", n, err, st, r[1])
		}
	}
	if got := harness.Names(t, filepath.Join(m.Dir, "mbr.raw.parts")); !slices.Equal(got, []string{"p1"}) {
		t.Errorf("MBR with p2 past the end of the disk: lists %q, want only p1", got)
	}
	log := m.LogText(t)
	if harness.CountLines(log, "gpt.qcow2") != 1 || harness.CountLines(log, "mbr.qcow2") != 1 {
		t.Errorf("want one log line per damaged table:\n%s", log)
	}
	if _, err := os.Stat(filepath.Join(m.Dir, "mbr.raw")); err != nil {
		t.Errorf("the whole disk is not served: %v", err)
	}
	// Holes past a partition's end are not the partition's: SEEK_DATA
	// past its end is ENXIO.
	f := harness.Open(t, filepath.Join(m.Dir, "mbr.raw.parts", "p1"))
	if _, err := unix.Seek(int(f.Fd()), 4<<20, unix.SEEK_DATA); !errors.Is(err, unix.ENXIO) {
		t.Errorf("SEEK_DATA at the end of p1: %v, want ENXIO", err)
	}
}

// TestPartitionTableWritten: a partition table written through a writable
// mount is seen by name as soon as its writer closes or fsyncs the disk
// file, without a listing of the folder first; so is a changed table, and
// a removed one is gone as soon. On a blank image: sfdisk writes a GPT
// onto DISK.raw, and at once losetup attaches DISK.raw.parts/p1, mkfs.ext4
// makes a file system on the loop device, and e2fsck reads it back
// through the mount; sfdisk writes an MBR whose p1 is larger over it, and
// at once stat shows p1 at its new size; wipefs -a removes the table, and
// at once DISK.raw.parts and p1 are gone. After unmount, qemu-img check
// finds the image clean, and e2fsck the file system in the range sfdisk
// sees p1 at in qemu-img convert's output of a run without wipefs. Both
// cache modes.
func TestPartitionTableWritten(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "sfdisk", "losetup", "mkfs.ext4", "e2fsck", "wipefs", "dd")
	for _, mode := range []string{"writeback", "write-through"} {
		t.Run(mode, func(t *testing.T) {
			src := qemu.TempDir(t)
			img := filepath.Join(src, "disk.qcow2")
			kept := filepath.Join(src, "kept.qcow2")
			qemu.Create(t, "qcow2", img, "64M")
			qemu.Create(t, "qcow2", kept, "64M")
			args := []string{"--writable"}
			if mode == "write-through" {
				args = append(args, "--no-writeback-cache")
			}
			m := harness.Mount(t, src, args...)
			partition := func(disk, table string) {
				t.Helper()
				harness.Partition(t, disk, table)
			}
			wantSize := func(path string, size int64) {
				t.Helper()
				if st, err := os.Stat(path); err != nil || st.Size() != size {
					t.Fatalf("stat %s: %v, %v; want %d bytes", path, st, err, size)
				}
			}
			for _, name := range []string{"disk", "kept"} {
				disk := filepath.Join(m.Dir, name+".raw")
				p1 := filepath.Join(m.Dir, name+".raw.parts", "p1")
				partition(disk, "label: gpt\nstart=2048, size=16MiB, type=linux\n")
				dev, detach := harness.AttachLoop(t, p1)
				qemu.Run(t, "mkfs.ext4", "-q", "-F", dev)
				detach()
				harness.Fsck(t, p1)
				wantSize(p1, 16<<20)
				if name == "kept" {
					continue
				}
				partition(disk, "label: dos\nstart=2048, size=32MiB, type=83\n")
				wantSize(p1, 32<<20)
				if got := harness.Names(t, filepath.Join(m.Dir, name+".raw.parts")); !slices.Equal(got, []string{"p1"}) {
					t.Errorf("after the new table, %s.raw.parts lists %q, want p1 only", name, got)
				}
				qemu.Run(t, "wipefs", "-q", "-a", "-f", disk)
				for _, p := range []string{p1, filepath.Dir(p1)} {
					if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
						t.Errorf("stat %s after wipefs: %v, want ENOENT", p, err)
					}
				}
			}
			m.Unmount(t)
			qemu.CheckClean(t, img)
			qemu.CheckClean(t, kept)
			raw := qemu.ToRaw(t, kept, filepath.Join(t.TempDir(), "kept.raw"))
			r := sfdiskParts(t, raw)[1]
			part := filepath.Join(t.TempDir(), "p1.img")
			qemu.Run(t, "dd", "if="+raw, "of="+part, "bs=1M", "iflag=skip_bytes,count_bytes",
				fmt.Sprintf("skip=%d", r[0]), fmt.Sprintf("count=%d", r[1]), "status=none")
			harness.Fsck(t, part) // p1 in qemu-img convert's output
		})
	}
}

// TestPartitionTableFromOutside: a lookup of DISK.raw.parts checks the
// disk behind it: after another program (qemu-io here) writes a partition
// table into an image the mount has seen without one, the folder is found
// by name at once, without a listing.
func TestPartitionTableFromOutside(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "sfdisk", "dd")
	work := t.TempDir()
	table := filepath.Join(work, "table.img")
	qemu.Run(t, "truncate", "-s", "64M", table)
	harness.Partition(t, table, "label: dos\nstart=2048, size=16MiB, type=83\n")
	mbr := filepath.Join(work, "mbr.bin")
	qemu.Run(t, "dd", "if="+table, "of="+mbr, "bs=512", "count=1", "status=none")

	src := qemu.TempDir(t)
	img := filepath.Join(src, "disk.qcow2")
	qemu.Create(t, "qcow2", img, "64M")
	m := harness.Mount(t, src)
	parts := filepath.Join(m.Dir, "disk.raw.parts")
	if _, err := os.Stat(parts); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("stat %s of a blank disk: %v, want ENOENT", parts, err)
	}
	qemu.IO(t, img, "write -s "+mbr+" 0 512")
	if st, err := os.Stat(filepath.Join(parts, "p1")); err != nil || st.Size() != 16<<20 {
		t.Errorf("stat p1 after qemu-io wrote the table: %v, %v; want %d bytes", st, err, 16<<20)
	}
}

// TestLoopMountGuestPartition is what a user does with an exposed raw file:
// attach it to a loop device, find the partition in it and mount the guest
// file system. The kernel, not qemu, reads the disk here: page-sized reads
// through the loop driver, ext4's own readahead, the GPT read by partx or
// the kernel. The files read back must be the files put in, byte for byte.
func TestLoopMountGuestPartition(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "sfdisk", "mkfs.ext4", "losetup", "partx", "mount")

	work := qemu.TempDir(t)
	want := harness.WriteGuestTree(t, filepath.Join(work, "tree"))
	disk := harness.MakeGuestDisk(t, work, filepath.Join(work, "tree"))

	for _, v := range []struct {
		name string
		opts []string // for qemu-img convert
	}{
		{"plain", nil},
		// Random data does not compress, so this image mixes
		// compressed clusters (text, ext4 metadata) with clusters qemu
		// stored uncompressed.
		{"compressed", []string{"-c"}},
	} {
		t.Run(v.name, func(t *testing.T) {
			src := qemu.TempDir(t)
			args := append(append([]string{"convert", "-q", "-f", "raw", "-O", "qcow2"}, v.opts...),
				disk, filepath.Join(src, "disk.qcow2"))
			qemu.Img(t, args...)

			// Each step registers its own undoing as soon as there
			// is something to undo; Cleanup runs them last first,
			// so the guest is unmounted, then the partitions and
			// the loop device go, then the harness unmounts qcowfs.
			m := harness.Mount(t, src)
			dev, _ := harness.AttachLoop(t, filepath.Join(m.Dir, "disk.raw"), "-r", "-P")
			part := harness.PartitionNode(t, dev)
			guest, _ := harness.MountGuest(t, part, "ro,noload")

			got := harness.ReadTree(t, guest)
			harness.CompareTrees(t, got, want)
			if log := m.LogText(t); strings.Contains(log, "level=ERROR") {
				t.Errorf("the daemon logged errors:\n%s", log)
			}
		})
	}
}
