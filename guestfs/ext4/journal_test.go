package ext4

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/guestfs"
	"github.com/qcowfs/qcowfs/guestfs/guesttest"
)

// A journalCase is a way to leave a file system that needs recovery: the
// mkfs options and the mount options the kernel writes it with.
type journalCase struct {
	name  string
	mkfs  []string
	mount string
	// features: what dumpe2fs must say of the journal.
	features string
	// revokes: the log must hold revoke blocks (debugfs logdump says).
	revokes bool
}

var journalCases = []journalCase{
	// Checksums v3, 64-bit tags.
	{name: "ext4", mkfs: []string{"-b", "4096"}, revokes: true, features: "journal_64bit journal_checksum_v3"},
	{name: "ext4-1k", mkfs: []string{"-b", "1024"}, revokes: true, features: "journal_64bit journal_checksum_v3"},
	// File data through the journal, blocks that start with jbd2's magic
	// escaped.
	{name: "ext4-data-journal", mkfs: []string{"-b", "4096"}, mount: "data=journal"},
	// No checksums, 32-bit tags, block maps.
	{name: "ext3", mkfs: []string{"-t", "ext3", "-b", "4096"}},
	// Checksums v1 (crc32_be over each transaction), and asynchronous
	// commits (which the kernel takes only without data=ordered).
	{name: "ext4-csum-v1", mkfs: []string{"-b", "4096", "-O", "^metadata_csum"}, mount: "journal_checksum", features: "journal_checksum"},
	{name: "ext4-async-commit", mkfs: []string{"-b", "4096", "-O", "^metadata_csum"}, mount: "journal_checksum,journal_async_commit,data=writeback", features: "journal_checksum journal_async_commit"},
}

// needsRecovery makes an image of case c whose journal holds committed
// transactions that are not yet in place: the kernel's mount writes a
// tree, then keeps writing with fsync after fsync (each a transaction),
// and the image is copied after the file system has been shut down with
// its log flushed (xfs_io's shutdown -f: a crash right after a commit),
// before it is unmounted.
func needsRecovery(t *testing.T, c journalCase) string {
	t.Helper()
	requireTools(t, "xfs_io", "dumpe2fs", "debugfs")
	img := mkfs(t, 128<<20, c.mkfs...)
	opts := "rw"
	if c.mount != "" {
		opts += "," + c.mount
	}
	mnt, unmount := mountImage(t, img, opts)
	writeLive(t, mnt)
	command(t, "xfs_io", "-x", "-c", "shutdown -f", mnt)
	snap := filepath.Join(t.TempDir(), "snap.img")
	command(t, "cp", "--sparse=always", img, snap)
	unmount()
	out := command(t, "dumpe2fs", "-h", snap)
	if !regexp.MustCompile(`features:.* needs_recovery`).MatchString(out) {
		t.Fatalf("the snapshot does not need recovery:\n%s", out)
	}
	features := regexp.MustCompile(`Journal features: +(.*)`).FindStringSubmatch(out)
	for _, f := range strings.Fields(c.features) {
		if features == nil || !slices.Contains(strings.Fields(features[1]), f) {
			t.Fatalf("the journal lacks feature %s:\n%s", f, out)
		}
	}
	return snap
}

// writeLive is the guest's work: a tree written and synced, then changes
// that only the journal holds.
func writeLive(t *testing.T, mnt string) {
	t.Helper()
	check := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	p := func(rel string) string { return filepath.Join(mnt, rel) }
	write := func(rel string, b []byte, sync bool) {
		f, err := os.Create(p(rel))
		check(err)
		_, err = f.Write(b)
		check(err)
		if sync {
			check(f.Sync())
		}
		check(f.Close())
	}
	fill := func(n int, c byte) []byte { return []byte(strings.Repeat(string(c), n)) }

	// Synced: in place before the journal's transactions.
	check(os.Mkdir(p("a"), 0o755))
	for i := range 50 {
		write(fmt.Sprintf("a/f%d", i), fill(100*i+1, 'a'), false)
	}
	check(os.Mkdir(p("big"), 0o755))
	for i := range 600 {
		write(fmt.Sprintf("big/entry-%04d-%s", i, strings.Repeat("y", i%30)), nil, false)
	}
	write("a/overwritten", fill(20000, 'o'), false)
	fd, err := os.Open(mnt)
	check(err)
	check(unix.Syncfs(int(fd.Fd())))
	fd.Close()

	// In the journal only: a transaction per fsync.
	check(os.Mkdir(p("new"), 0o755))
	for i := range 100 {
		write(fmt.Sprintf("new/g%d", i), fill(100*i, byte('0'+i%10)), true)
	}
	magic := append([]byte{0xC0, 0x3B, 0x39, 0x98}, fill(8000, 'm')...) // escaped in the journal
	write("new/magic", magic, true)
	check(os.Rename(p("a/f1"), p("new/renamed")))
	check(os.Remove(p("a/f2")))
	check(os.Chmod(p("a/f3"), 0o600))
	check(os.Chown(p("a/f4"), 1234, 567890))
	check(unix.UtimesNano(p("a/f5"), []unix.Timespec{{Sec: 2e9, Nsec: 5}, {Sec: 1e9, Nsec: 999999999}}))
	check(os.Truncate(p("a/f6"), 0))
	f, err := os.OpenFile(p("a/overwritten"), os.O_WRONLY, 0)
	check(err)
	_, err = f.WriteAt(fill(5000, 'n'), 7000)
	check(err)
	check(f.Sync())
	check(f.Close())
	// Directory blocks journalled, then freed (revoke records), then
	// likely reused for file data: replaying them would clobber it.
	check(os.Mkdir(p("churn"), 0o755))
	for i := range 400 {
		write(fmt.Sprintf("churn/%03d-%s", i, strings.Repeat("z", 40)), nil, false)
	}
	write("churn/sync", nil, true)
	check(os.RemoveAll(p("churn")))
	write("after-remove", nil, true) // commits the frees, so the blocks may be reused
	// Fill the file system, so that they are.
	var sf unix.Statfs_t
	check(unix.Statfs(mnt, &sf))
	write("reuse", fill(int(sf.Bavail)*int(sf.Bsize)-(2<<20), 'r'), true)
	for i := 0; i < 600; i += 3 {
		check(os.Remove(p(fmt.Sprintf("big/entry-%04d-%s", i, strings.Repeat("y", i%30)))))
	}
	for i := range 200 {
		write(fmt.Sprintf("big/later-%d", i), nil, false)
	}
	write("last", []byte("the last transaction"), true)
}

// recoveredByKernel mounts a copy of img read-only on a writable loop
// device, where the kernel replays the journal (on a read-only device it
// refuses to mount), and reads it; with noload, it mounts without
// replaying, which shows the blocks in place.
func recoveredByKernel(t *testing.T, img string, noload bool) (guesttest.Tree, error) {
	t.Helper()
	cp := filepath.Join(t.TempDir(), "copy.img")
	command(t, "cp", "--sparse=always", img, cp)
	dev := strings.TrimSpace(command(t, "losetup", "-f", "--show", cp))
	defer commandErr("losetup", "-d", dev)
	mnt := t.TempDir()
	opts := "ro"
	if noload {
		opts += ",noload"
	}
	if _, errOut, err := commandErr("mount", "-t", "ext4", "-o", opts, dev, mnt); err != nil {
		return nil, fmt.Errorf("mount: %v: %s", err, errOut)
	}
	defer func() {
		if _, e, err := commandErr("umount", mnt); err != nil {
			t.Errorf("umount: %v %s", err, e)
		}
	}()
	return guesttest.ReadOSErr(mnt, "lost+found")
}

// TestJournalReplay reads file systems that need recovery: Open replays
// the journal in memory, and every path must then read as the kernel's
// read-only mount shows it after its own replay, to the nanosecond and
// the block; and not as the kernel shows it without replay (noload),
// which proves the journal held what the test reads.
func TestJournalReplay(t *testing.T) {
	requireRoot(t)
	for i, c := range journalCases {
		t.Run(c.name, func(t *testing.T) {
			if testing.Short() && i > 0 {
				t.Skip("-short: the first case only")
			}
			t.Parallel()
			img := needsRecovery(t, c)
			logdump := command(t, "debugfs", "-R", "logdump", img)
			if c.revokes && !strings.Contains(logdump, "revoke table") {
				t.Errorf("the log holds no revoke blocks (debugfs logdump):\n%.2000s", logdump)
			}
			fsys := openImage(t, img)
			if fsys.Replayed() == 0 {
				t.Fatal("Open replayed no blocks")
			}
			got := guesttest.ReadFS(t, fsys, "lost+found")
			kernel, err := recoveredByKernel(t, img, false)
			if err != nil {
				t.Fatal(err)
			}
			guesttest.Compare(t, "against the kernel's mount after its replay", got, kernel, guesttest.Kernel)
			// Without the replay the kernel shows another tree, or
			// fails to read it (inodes whose blocks are half in
			// place fail their checksums).
			stale, err := recoveredByKernel(t, img, true)
			if err == nil && len(guesttest.Diff(stale, kernel, guesttest.Kernel)) == 0 {
				t.Error("the kernel shows the same without replaying the journal: the test proves nothing")
			}
		})
	}
}

// TestJournalDamaged damages the journal of a file system that needs
// recovery, and checks that Open refuses it, naming the journal, where
// the kernel's mount refuses it: a journalled block, or a commit block,
// whose checksum does not match.
func TestJournalDamaged(t *testing.T) {
	requireRoot(t)
	img := needsRecovery(t, journalCases[0])
	dump := command(t, "debugfs", "-R", "logdump -a", img)
	// The data block of the last tag, and the last commit block.
	tags := regexp.MustCompile(`FS block \d+ logged at journal block (\d+)`).FindAllStringSubmatch(dump, -1)
	commits := regexp.MustCompile(`type 2 \(commit block\) at block (\d+)`).FindAllStringSubmatch(dump, -1)
	if len(tags) == 0 || len(commits) == 0 {
		t.Fatalf("no tags or commit blocks in debugfs logdump:\n%.2000s", dump)
	}
	for _, c := range []struct {
		name   string
		jblock string
		offset int64
	}{
		{name: "data block", jblock: tags[len(tags)-1][1], offset: 100},
		{name: "commit block", jblock: commits[len(commits)-1][1], offset: 0x10},
	} {
		t.Run(c.name, func(t *testing.T) {
			bad := filepath.Join(t.TempDir(), "bad.img")
			command(t, "cp", "--sparse=always", img, bad)
			flipByte(t, bad, journalBlockOnDisk(t, bad, c.jblock)*4096+c.offset)
			if _, err := recoveredByKernel(t, bad, false); err == nil {
				t.Fatal("the kernel mounted it: the damage is not what the test means")
			}
			f, err := os.Open(bad)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			st, _ := f.Stat()
			_, err = Open(f, st.Size())
			var fe *guestfs.FormatError
			if !errors.As(err, &fe) || !strings.HasPrefix(fe.Field, "journal ") {
				t.Fatalf("Open: %v; want a FormatError about the journal, as the kernel refuses it", err)
			}
		})
	}
}

// journalBlockOnDisk maps block jblock of the journal (inode 8) to the
// file system's block, as debugfs bmap does.
func journalBlockOnDisk(t *testing.T, img, jblock string) int64 {
	t.Helper()
	out := strings.TrimSpace(command(t, "debugfs", "-R", "bmap <8> "+jblock, img))
	n, err := strconv.ParseInt(out, 10, 64)
	if err != nil {
		t.Fatalf("debugfs bmap <8> %s: %q", jblock, out)
	}
	return n
}

// flipByte inverts the byte at off of file name.
func flipByte(t *testing.T, name string, off int64) {
	t.Helper()
	f, err := os.OpenFile(name, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0xFF
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}
