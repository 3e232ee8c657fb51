package hostile

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// readWithin reads n bytes at off of file, failing the test if the read
// does not answer within d: a hostile image must not hang the daemon.
func readWithin(t *testing.T, path string, off int64, n int, d time.Duration) ([]byte, error) {
	t.Helper()
	return harness.Within(t, fmt.Sprintf("reading %s at %d", path, off), d, func() ([]byte, error) {
		f, err := os.Open(path)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		b := make([]byte, n)
		k, err := f.ReadAt(b, off)
		return b[:k], err
	})
}

// TestHostileImages mounts a folder of malformed and hostile images beside
// good ones. Every bad image is refused (not shown, one log line naming
// the file and the reason) or fails just the affected reads with EIO; no
// read hangs, the daemon keeps serving, nothing outside the source folder
// is ever read, and the good images read byte-exact.
func TestHostileImages(t *testing.T) {
	harness.RequireFUSE(t)
	src := qemu.TempDir(t)
	mk := func(name, size string, opts ...string) string {
		p := filepath.Join(src, name)
		qemu.Create(t, "qcow2", p, size, opts...)
		return p
	}
	good := mk("good.qcow2", "4M")
	qemu.IO(t, good, "write -P 0x61 0 1M", "write -P 0x62 3M 64k")

	// Refused at open, each for a named reason (the field, or the
	// feature, or the policy), which the log line must carry.
	refused := map[string]string{}
	refuse := func(name, reason string) { refused[name] = reason }

	qemu.PatchU(t, mk("bits.qcow2", "1M"), qemu.HeaderClusterBits, 4, 40)
	refuse("bits.qcow2", "cluster_bits")
	qemu.PatchU(t, mk("l1huge.qcow2", "1M"), qemu.HeaderL1Size, 4, 0x7fffffff)
	refuse("l1huge.qcow2", "l1_size")
	qemu.PatchU(t, mk("l1eof.qcow2", "1M"), qemu.HeaderL1TableOffset, 8, 1<<40)
	refuse("l1eof.qcow2", "l1_table_offset")
	qemu.PatchU(t, mk("version.qcow2", "1M"), qemu.HeaderVersion, 4, 4)
	refuse("version.qcow2", "version 4")
	qemu.PatchU(t, mk("reftable.qcow2", "1M"), qemu.HeaderRefcountTableClusters, 4, 1<<20)
	refuse("reftable.qcow2", "refcount_table_clusters")

	// Truncated: the L2 table is gone.
	trunc := mk("truncated.qcow2", "4M")
	qemu.IO(t, trunc, "write -P 0x63 0 1M")
	os.Truncate(trunc, 3*65536)
	refuse("truncated.qcow2", "past the end of the file")

	// An unknown incompatible feature, named in the image's own feature
	// name table (qemu refuses it by that name too).
	unk := mk("unknown.qcow2", "1M")
	ft := qemu.HeaderExtension(t, unk, 0x6803f857)
	qemu.WriteAt(t, unk, ft+8, append([]byte{0, 9}, []byte("teleportation\x00")...))
	qemu.PatchU(t, unk, qemu.HeaderIncompatibleFeatures, 8, 1<<9)
	if out, _ := exec.Command("qemu-img", "info", unk).CombinedOutput(); !strings.Contains(string(out), "teleportation") {
		t.Fatalf("qemu-img info does not name the feature: %s", out)
	}
	refuse("unknown.qcow2", "teleportation")

	// Encryption.
	qemu.CreateEncrypted(t, filepath.Join(src, "luks.qcow2"), "luks")
	refuse("luks.qcow2", "encrypted: no key given")
	qemu.PatchU(t, mk("aes.qcow2", "1M"), qemu.HeaderCryptMethod, 4, 1)
	refuse("aes.qcow2", "encrypted: no key given")

	// The corrupt bit.
	qemu.PatchU(t, mk("corrupt.qcow2", "1M"), qemu.HeaderIncompatibleFeatures, 8, 2)
	refuse("corrupt.qcow2", "corrupt bit")

	// Backing files that reach outside the source folder, or loop.
	qemu.Img(t, "create", "-q", "-f", "qcow2", "-u", "-b", "/etc/passwd", "-F", "raw", filepath.Join(src, "passwd.qcow2"), "1M")
	refuse("passwd.qcow2", "outside the allowed folders")
	os.Symlink("/etc/shadow", filepath.Join(src, "innocent.raw"))
	qemu.Img(t, "create", "-q", "-f", "qcow2", "-u", "-b", "innocent.raw", "-F", "raw", filepath.Join(src, "symlinked.qcow2"), "1M")
	refuse("symlinked.qcow2", "outside the allowed folders")
	qemu.Img(t, "create", "-q", "-f", "qcow2", "-u", "-b", `json:{"driver":"file","filename":"/etc/passwd"}`, "-F", "raw", filepath.Join(src, "json.qcow2"), "1M")
	refuse("json.qcow2", "json: pseudo-protocol")
	qemu.Img(t, "create", "-q", "-f", "qcow2", "-u", "-b", "nbd:localhost:10809", "-F", "raw", filepath.Join(src, "nbd.qcow2"), "1M")
	refuse("nbd.qcow2", `protocol \"nbd\"`)
	qemu.Img(t, "create", "-q", "-f", "qcow2", "-u", "-b", "loop-b.qcow2", "-F", "qcow2", filepath.Join(src, "loop-a.qcow2"), "1M")
	qemu.Img(t, "create", "-q", "-f", "qcow2", "-u", "-b", "loop-a.qcow2", "-F", "qcow2", filepath.Join(src, "loop-b.qcow2"), "1M")
	refuse("loop-a.qcow2", "loops back")
	refuse("loop-b.qcow2", "loops back")
	qemu.Img(t, "create", "-q", "-f", "qcow2", "-u", "-b", "gone.qcow2", "-F", "qcow2", filepath.Join(src, "missing.qcow2"), "1M")
	refuse("missing.qcow2", "no such file")

	// Served, but reads of the damaged clusters fail with EIO.
	l2eof := mk("l2eof.qcow2", "4M")
	qemu.IO(t, l2eof, "write -P 0x64 0 256k")
	at, _ := qemu.L2EntryOffset(t, l2eof, 1)
	qemu.PatchU(t, l2eof, at, 8, 1<<63|1<<41)

	// Served as is: dirty, lazy refcounts, an unknown compatible bit, a
	// raw backing file with no format in the image (probed: raw, with a
	// warning), and a qcow2 file declared raw (read as raw, not probed).
	dirty := mk("dirty.qcow2", "1M")
	qemu.IO(t, dirty, "write -P 0x65 0 64k")
	qemu.PatchU(t, dirty, qemu.HeaderIncompatibleFeatures, 8, 1)
	lazy := mk("lazy.qcow2", "1M", "-o", "lazy_refcounts=on")
	qemu.IO(t, lazy, "write -P 0x66 0 64k")
	compat := mk("compat.qcow2", "1M")
	qemu.IO(t, compat, "write -P 0x67 0 64k")
	qemu.PatchU(t, compat, qemu.HeaderCompatibleFeatures, 8, 1<<17)
	base := filepath.Join(src, "base.img.raw")
	qemu.Create(t, "raw", base, "1M")
	noformat := mk("noformat.qcow2", "1M", "-b", "base.img.raw", "-F", "raw")
	qemu.PatchU(t, noformat, qemu.HeaderExtension(t, noformat, 0xe2792aca), 4, 0x5a5a5a5a)
	mk("declared-raw.qcow2", "2M", "-b", "good.qcow2", "-F", "raw")
	// A relative external data file name, resolved like a backing file
	// (relative to the image's folder; qemu resolves it against its own
	// working folder, so the oracle runs there).
	create := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-o", "data_file=rel.data,data_file_raw=on", "datafile.qcow2", "2M")
	create.Dir = src
	if out, err := create.CombinedOutput(); err != nil {
		t.Fatalf("qemu-img create: %v %s", err, out)
	}
	write := exec.Command("qemu-io", "-f", "qcow2", "-c", "write -P 0x68 4096 100k", "datafile.qcow2")
	write.Dir = src
	if out, err := write.CombinedOutput(); err != nil {
		t.Fatalf("qemu-io: %v %s", err, out)
	}
	served := []string{"good.qcow2", "dirty.qcow2", "lazy.qcow2", "compat.qcow2", "noformat.qcow2", "declared-raw.qcow2", "datafile.qcow2"}

	m := harness.Mount(t, src)
	listed := harness.Names(t, m.Dir)
	harness.Names(t, m.Dir) // a second listing must not log again
	log := m.LogText(t)
	for name, reason := range refused {
		if slices.Contains(listed, strings.TrimSuffix(name, ".qcow2")+".raw") {
			t.Errorf("%s is shown; it must be refused (%s)", name, reason)
		}
		n := 0
		for _, line := range strings.Split(log, "\n") {
			if strings.Contains(line, "image="+filepath.Join(src, name)) {
				n++
				if !strings.Contains(strings.ToLower(line), strings.ToLower(reason)) {
					t.Errorf("log line for %s does not say %q:\n%s", name, reason, line)
				}
			}
		}
		if n != 1 {
			t.Errorf("%d log lines for %s, want 1:\n%s", n, name, log)
		}
	}
	for _, name := range served {
		raw := strings.TrimSuffix(name, ".qcow2") + ".raw"
		if !slices.Contains(listed, raw) {
			t.Errorf("%s is not shown (listing %q)\n%s", name, listed, log)
			continue
		}
		// qemu-img convert is the oracle (it too follows the image's
		// backing format, or probes where there is none), run in the
		// source folder for the relative data file.
		out := filepath.Join(t.TempDir(), raw)
		convert := exec.Command("qemu-img", "convert", "-O", "raw", name, out)
		convert.Dir = src
		if b, err := convert.CombinedOutput(); err != nil {
			t.Fatalf("qemu-img convert %s: %v %s", name, err, b)
		}
		want, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		got, err := readWithin(t, filepath.Join(m.Dir, raw), 0, len(want), 10*time.Second)
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s: %v, or bytes differ from qemu-img convert", raw, err)
		}
	}
	for _, w := range []string{"dirty bit set", "has no format in the image; reading it as raw"} {
		if !strings.Contains(log, w) {
			t.Errorf("no warning %q in the log:\n%s", w, log)
		}
	}
	if _, err := readWithin(t, filepath.Join(m.Dir, "l2eof.raw"), 65536, 4096, 10*time.Second); !errors.Is(err, syscall.EIO) {
		t.Errorf("reading the damaged cluster of l2eof.raw: %v, want EIO", err)
	}
	if b, err := readWithin(t, filepath.Join(m.Dir, "l2eof.raw"), 0, 4096, 10*time.Second); err != nil || b[0] != 0x64 {
		t.Errorf("reading an intact cluster of l2eof.raw: %v", err)
	}
	// The daemon still serves the good image after all that.
	harness.SameFile(t, filepath.Join(m.Dir, "good.raw"), qemu.ToRaw(t, good, filepath.Join(t.TempDir(), "good.raw")))

	// With --allow-corrupt the corrupt image is served, with a warning.
	m2 := harness.Mount(t, src, "--allow-corrupt")
	if !slices.Contains(harness.Names(t, m2.Dir), "corrupt.raw") {
		t.Errorf("--allow-corrupt does not show corrupt.raw")
	}
	if log := m2.LogText(t); !strings.Contains(log, "corrupt bit set") {
		t.Errorf("no warning for the corrupt image:\n%s", log)
	}
}
