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

// TestHostileImages mounts a folder of malformed and hostile images beside
// good ones. Every bad image is refused (not shown, one log line naming
// the file and the reason) or fails just the affected reads with EIO; no
// read hangs, the daemon keeps serving, nothing outside the source folder
// is ever read, and the good images read byte-exact.
func TestHostileImages(t *testing.T) {
	src := harness.SourceDir(t)
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

// TestHostileAgreeWithQemu: where qemu decides what an odd image means,
// the mount agrees. A size field of 1 MiB + 123 is a disk of 1 MiB
// (qemu-img info, qemu-img convert); a snapshot whose disk size is not a
// whole number of sectors cannot be applied by qemu, and is not shown;
// two snapshots with the same ID are each served with their own content
// (qemu-img convert -l snapshot.name=).
func TestHostileAgreeWithQemu(t *testing.T) {
	src := harness.SourceDir(t)
	odd := qemu.Make(t, filepath.Join(src, "odd.qcow2"), "2M", "write -P 0x41 0 2M")
	qemu.PatchU(t, odd, qemu.HeaderSize, 8, 1<<20+123)

	snaps := qemu.Make(t, filepath.Join(src, "snaps.qcow2"), "1M", "write -P 0x51 0 64k")
	qemu.Img(t, "snapshot", "-c", "first", snaps)
	qemu.IO(t, snaps, "write -P 0x52 0 64k")
	qemu.Img(t, "snapshot", "-c", "second", snaps)
	qemu.IO(t, snaps, "write -P 0x53 0 64k")
	qemu.Img(t, "snapshot", "-c", "oddsize", snaps)
	// The second takes the first's ID ("1", same length as "2").
	qemu.PatchU(t, snaps, qemu.SnapshotEntryOffset(t, snaps, 1)+64, 1, '1')
	qemu.PatchU(t, snaps, qemu.SnapshotEntryOffset(t, snaps, 2)+qemu.SnapshotDiskSize, 8, 1<<20+512+100)
	cp := filepath.Join(t.TempDir(), "apply.qcow2")
	qemu.Run(t, "cp", snaps, cp)
	if err := exec.Command("qemu-img", "snapshot", "-a", "oddsize", cp).Run(); err == nil {
		t.Fatal("qemu-img applies the snapshot of odd size; the case expects it refused")
	}
	ids := []string{}
	for _, s := range qemu.Info(t, snaps)["snapshots"].([]any) {
		ids = append(ids, s.(map[string]any)["id"].(string))
	}
	if !slices.Equal(ids, []string{"1", "1", "3"}) {
		t.Fatalf("qemu-img info lists IDs %q", ids)
	}

	m := harness.Mount(t, src)
	listed := listWithin(t, m.Dir, 20*time.Second)
	want := qemu.Info(t, odd)["virtual-size"].(float64)
	st, err := os.Stat(filepath.Join(m.Dir, "odd.raw"))
	if err != nil || float64(st.Size()) != want {
		t.Errorf("odd.raw: %v, size %d; qemu-img info says %v", err, st.Size(), want)
	}
	sameWithin(t, filepath.Join(m.Dir, "odd.raw"), qemu.ToRaw(t, odd, filepath.Join(t.TempDir(), "odd.raw")), 20*time.Second)
	for _, name := range []string{"first", "second"} {
		raw := "snaps@" + name + ".raw"
		if !slices.Contains(listed, raw) {
			t.Errorf("%s is not listed: %q", raw, listed)
			continue
		}
		want := filepath.Join(t.TempDir(), name+".raw")
		qemu.Img(t, "convert", "-O", "raw", "-l", "snapshot.name="+name, snaps, want)
		sameWithin(t, filepath.Join(m.Dir, raw), want, 20*time.Second)
	}
	for _, name := range listed {
		if strings.Contains(name, "oddsize") {
			t.Errorf("%s is shown; qemu cannot apply that snapshot", name)
		}
	}
	if log := m.LogText(t); !strings.Contains(log, "snapshot not shown") || !strings.Contains(log, "multiple of 512") {
		t.Errorf("no line says why the snapshot of odd size is not shown:\n%s", log)
	}
	m.NoPanics(t)
	boundedAll(t, []string{odd, snaps})
}

// A patch is one hostile change to a template image: a field set to a
// value at the edge of its range.
type patch struct {
	name string
	tmpl string // template file name
	off  int64
	size int
	val  uint64
}

// edgeValues are the values a field of size bytes is set to: all ones,
// the top bit, and near the top (aligned, so that alignment checks pass
// and the arithmetic after them is what gets tried).
func edgeValues(size int) []uint64 {
	switch size {
	case 8:
		return []uint64{^uint64(0), 0xffffffffffff0000}
	case 4:
		return []uint64{0xffffffff, 0x80000000}
	case 2:
		return []uint64{0xffff}
	}
	return []uint64{0xff}
}

// TestHostileFieldsNearLimits sets every header field, the fields of a
// snapshot table entry, of the bitmaps extension and directory, extension
// lengths, and L1, L2 and refcount table entries to values near 2^64 (or
// the top of their width), one image each, in a folder with a canary. The
// listing answers, the canary reads exactly, the daemon logs no panic,
// every image shown reads what qemu reads or fails with EIO, every image
// not shown has a log line, and qcowfs info, map and check finish on every
// one within bounds of time and memory.
func TestHostileFieldsNearLimits(t *testing.T) {
	src := harness.SourceDir(t)
	tmpl := t.TempDir()

	// The templates: snapshots and bitmaps, and a backing file.
	full := qemu.Make(t, filepath.Join(tmpl, "full.qcow2"), "16M", "write -P 0x71 0 1M", "write -c -P 0x72 2M 128k")
	qemu.Img(t, "snapshot", "-c", "snap", full)
	qemu.Img(t, "bitmap", "--add", full, "bm")
	qemu.IO(t, full, "write -P 0x73 512k 1M", "write -z 4M 64k")
	base := filepath.Join(src, "base.raw.img")
	qemu.Create(t, "raw", base, "16M")
	qemu.Run(t, "sh", "-c", "printf 'BASEBASE' | dd of="+base+" conv=notrunc status=none")
	backed := filepath.Join(tmpl, "backed.qcow2")
	qemu.Create(t, "qcow2", backed, "16M", "-b", base, "-F", "raw")
	qemu.IO(t, backed, "write -P 0x74 1M 64k")

	var patches []patch
	add := func(name, tmplName string, off int64, size int) {
		for _, v := range edgeValues(size) {
			patches = append(patches, patch{fmt.Sprintf("%s-%x", name, v), tmplName, off, size, v})
		}
	}
	for _, f := range []struct {
		name string
		off  int64
		size int
	}{
		{"backing_file_offset", qemu.HeaderBackingFileOffset, 8}, {"backing_file_size", qemu.HeaderBackingFileSize, 4},
		{"cluster_bits", qemu.HeaderClusterBits, 4}, {"size", qemu.HeaderSize, 8}, {"crypt_method", qemu.HeaderCryptMethod, 4},
		{"l1_size", qemu.HeaderL1Size, 4}, {"l1_table_offset", qemu.HeaderL1TableOffset, 8},
		{"refcount_table_offset", qemu.HeaderRefcountTableOffset, 8}, {"refcount_table_clusters", qemu.HeaderRefcountTableClusters, 4},
		{"nb_snapshots", qemu.HeaderNbSnapshots, 4}, {"snapshots_offset", qemu.HeaderSnapshotsOffset, 8},
		{"incompatible_features", qemu.HeaderIncompatibleFeatures, 8}, {"compatible_features", qemu.HeaderCompatibleFeatures, 8},
		{"autoclear_features", qemu.HeaderAutoclearFeatures, 8}, {"refcount_order", qemu.HeaderRefcountOrder, 4},
		{"header_length", qemu.HeaderHeaderLength, 4},
	} {
		add("hdr-"+f.name, "full.qcow2", f.off, f.size)
		if f.name == "backing_file_offset" || f.name == "backing_file_size" {
			add("hdr-backed-"+f.name, "backed.qcow2", f.off, f.size)
		}
	}
	sn := qemu.SnapshotEntryOffset(t, full, 0)
	for _, f := range []struct {
		name string
		off  int64
		size int
	}{
		{"l1_table_offset", 0, 8}, {"l1_size", 8, 4}, {"id_str_size", 12, 2}, {"name_size", 14, 2},
		{"extra_data_size", 36, 4}, {"vm_state_size_large", 40, 8}, {"disk_size", 48, 8},
	} {
		add("snap-"+f.name, "full.qcow2", sn+f.off, f.size)
	}
	_, _, dir, ext := qemu.BitmapDirectory(t, full)
	for _, f := range []struct {
		name string
		off  int64
		size int
	}{
		{"nb_bitmaps", ext, 4}, {"directory_size", ext + 8, 8}, {"directory_offset", ext + 16, 8},
		{"table_offset", dir, 8}, {"table_size", dir + 8, 4}, {"granularity", dir + 17, 1},
		{"name_size", dir + 18, 2}, {"extra_data_size", dir + 20, 4},
	} {
		add("bitmap-"+f.name, "full.qcow2", f.off, f.size)
	}
	hl := int64(qemu.ReadU(t, full, qemu.HeaderHeaderLength, 4))
	add("ext-length", "full.qcow2", hl+4, 4)
	l1 := int64(qemu.ReadU(t, full, qemu.HeaderL1TableOffset, 8))
	add("l1-entry", "full.qcow2", l1, 8)
	rt := int64(qemu.ReadU(t, full, qemu.HeaderRefcountTableOffset, 8))
	add("reftable-entry", "full.qcow2", rt, 8)
	l2at, _ := qemu.L2EntryOffset(t, full, 0)
	add("l2-entry", "full.qcow2", l2at, 8)
	cat, _ := qemu.L2EntryOffset(t, full, 32) // the compressed cluster at 2 MiB
	patches = append(patches, patch{"l2-compressed-max", "full.qcow2", cat, 8, 1<<62 | (1<<62 - 1)})

	var hostile []string
	for _, p := range patches {
		dst := filepath.Join(src, p.name+".qcow2")
		qemu.Run(t, "cp", filepath.Join(tmpl, p.tmpl), dst)
		qemu.PatchU(t, dst, p.off, p.size, p.val)
		hostile = append(hostile, dst)
	}
	good := qemu.Make(t, filepath.Join(src, "good.qcow2"), "4M", "write -P 0x61 0 1M", "write -P 0x62 3M 64k")
	goodRaw := qemu.ToRaw(t, good, filepath.Join(t.TempDir(), "good.raw"))

	m := harness.Mount(t, src)
	pid := m.PID(t)
	before := harness.ReadProc(t, pid)
	start := time.Now()
	listed := listWithin(t, m.Dir, 120*time.Second)
	t.Logf("listing %d hostile images and a canary: %v", len(hostile), time.Since(start).Round(time.Millisecond))
	if !slices.Contains(listed, "good.raw") {
		t.Fatalf("the canary is not listed: %q", listed)
	}
	sameWithin(t, filepath.Join(m.Dir, "good.raw"), goodRaw, 30*time.Second)
	log := m.LogText(t)
	shown, compared := 0, 0
	for _, p := range hostile {
		raw := strings.TrimSuffix(filepath.Base(p), ".qcow2") + ".raw"
		if !slices.Contains(listed, raw) {
			if !strings.Contains(log, "image="+p) {
				t.Errorf("%s is not shown and no log line says why", filepath.Base(p))
			}
			continue
		}
		shown++
		got, err := probeImage(t, filepath.Join(m.Dir, raw))
		if err != nil {
			if !errIs(err, syscall.EIO) {
				t.Errorf("%s: %v, want data or EIO", raw, err)
			}
			continue
		}
		if want, ok := qemuConvert(t, p); ok {
			compared++
			if !bytes.Equal(got, want) {
				t.Errorf("%s: the bytes served differ from qemu-img convert's", raw)
			}
		}
	}
	t.Logf("%d hostile images: %d shown (%d compared with qemu-img convert), %d refused", len(hostile), shown, compared, len(hostile)-shown)
	m.NoPanics(t)
	// Once its background counts are done, the daemon holds no image.
	harness.WaitFor(t, "the daemon to close every image", 60*time.Second, func() bool { return harness.ReadProc(t, pid).Files <= before.Files })
	t.Logf("daemon before: %v; after: %v", before, harness.ReadProc(t, pid))
	boundedAll(t, hostile)
}

// luksHeader returns where the LUKS header of the encrypted image at path
// lies (the crypto header extension's offset field).
func luksHeader(t *testing.T, path string) int64 {
	t.Helper()
	ext := qemu.HeaderExtension(t, path, 0x0537be77)
	return int64(qemu.ReadU(t, path, ext+8, 8))
}

// LUKS1 header fields (all big-endian), from the header's start.
const (
	luksMKDigestIter = 164
	luksSlot0        = 208 // each slot: active, iterations, salt[32], key material offset, stripes
	luksSlotIters    = 4
	luksSlotOffset   = 40
	luksSlotStripes  = 44
)

// TestHostileEncrypted: encrypted images with a damaged LUKS header, a
// corrupted key slot, iteration counts of 2^31, or a cipher qcowfs does
// not implement, beside a good encrypted image, all with the right key.
// Each bad one is not shown, with one line naming it and the reason, in
// bounded time (the mount, PBKDF2 included, within 30 s); the good one
// reads as qemu reads it; the daemon does not crash. Each alone, as a
// single-image mount, fails within the same bound. Where qemu can open
// the image at all, it refuses it too.
func TestHostileEncrypted(t *testing.T) {
	src := harness.SourceDir(t)
	const pass = "hostile pass"
	key := filepath.Join(t.TempDir(), "key")
	os.WriteFile(key, []byte(pass), 0o600)
	mk := func(name, opts string) string {
		p := filepath.Join(src, name)
		qemu.CreateLUKS(t, p, pass, "1M", opts)
		return p
	}
	good := mk("good.qcow2", "")
	ge := qemu.EncImage{Name: "good", Path: good, Secrets: map[string]string{"good.qcow2": pass}, Chain: []string{"good.qcow2"}}
	ge.IO(t, "write -P 0x61 0 64k")

	refused := map[string]string{} // name -> what its line must say
	qemuRefuses := map[string]bool{}

	// The key slot's material overwritten: no slot opens (qemu: "Invalid
	// password").
	slot := mk("slot.qcow2", "")
	h := luksHeader(t, slot)
	material := int64(qemu.ReadU(t, slot, h+luksSlot0+luksSlotOffset, 4)) * 512
	qemu.WriteAt(t, slot, h+material+100, []byte(strings.Repeat("\xa5", 64)))
	refused["slot.qcow2"] = "encrypted: wrong passphrase"
	qemuRefuses["slot.qcow2"] = true

	// 2^31 iterations in the key slot, and in the master key digest:
	// refused before any PBKDF2 (qemu would spend minutes on each).
	iters := mk("iters.qcow2", "")
	qemu.PatchU(t, iters, luksHeader(t, iters)+luksSlot0+luksSlotIters, 4, 1<<31)
	refused["iters.qcow2"] = "LUKS key slot 0 iterations = 0x80000000"
	bound := map[string]bool{"iters.qcow2": true, "digest.qcow2": true} // say the bound
	digest := mk("digest.qcow2", "")
	qemu.PatchU(t, digest, luksHeader(t, digest)+luksMKDigestIter, 4, 1<<31)
	refused["digest.qcow2"] = "LUKS mk_digest_iter = 0x80000000"

	// Absurd stripes; key material past the header area; bad magic.
	stripes := mk("stripes.qcow2", "")
	qemu.PatchU(t, stripes, luksHeader(t, stripes)+luksSlot0+luksSlotStripes, 4, 1<<30)
	refused["stripes.qcow2"] = "LUKS key slot 0 stripes = 0x40000000"
	qemuRefuses["stripes.qcow2"] = true
	offset := mk("offset.qcow2", "")
	qemu.PatchU(t, offset, luksHeader(t, offset)+luksSlot0+luksSlotOffset, 4, 1<<30)
	refused["offset.qcow2"] = "key slot 0 key_material_offset"
	qemuRefuses["offset.qcow2"] = true
	magic := mk("magic.qcow2", "")
	qemu.WriteAt(t, magic, luksHeader(t, magic), []byte("SKUL"))
	refused["magic.qcow2"] = "not a LUKS header"
	qemuRefuses["magic.qcow2"] = true

	// A cipher qemu makes and qcowfs does not implement.
	mk("serpent.qcow2", "encrypt.cipher-alg=serpent-256")
	refused["serpent.qcow2"] = `LUKS cipher "serpent" is not supported`

	for name := range qemuRefuses {
		out, err := exec.Command("qemu-io", "-r", "--object", "secret,id=s0,file="+key, "--image-opts",
			"driver=qcow2,file.filename="+filepath.Join(src, name)+",encrypt.key-secret=s0", "-c", "read 0 512").CombinedOutput()
		if err == nil {
			t.Errorf("qemu opens %s: %s", name, out)
		}
	}

	start := time.Now()
	m := harness.Racy.Mount(t, src, "--key-file", key)
	if d := time.Since(start); d > 30*time.Second {
		t.Errorf("the mount took %v", d)
	}
	for name, why := range refused {
		if _, err := os.Stat(filepath.Join(m.Dir, strings.TrimSuffix(name, ".qcow2")+".raw")); err == nil {
			t.Errorf("%s is shown", name)
		}
		lines := 0
		for _, l := range strings.Split(m.Said, "\n") {
			if strings.Contains(l, "not shown: "+filepath.Join(src, name)+":") {
				lines++
				if !strings.Contains(l, why) || bound[name] && !strings.Contains(l, "not between 1 and 33554432") {
					t.Errorf("%s: %q does not say %q", name, l, why)
				}
			}
		}
		if lines != 1 {
			t.Errorf("%s: %d not shown lines:\n%s", name, lines, m.Said)
		}
	}
	raw := ge.ToRaw(t, filepath.Join(t.TempDir(), "good.raw"))
	if b, err := exec.Command("cmp", filepath.Join(m.Dir, "good.raw"), raw).CombinedOutput(); err != nil {
		t.Errorf("good.raw: %v %s", err, b)
	}
	m.NoPanics(t)

	for name, why := range refused {
		mnt := t.TempDir()
		harness.Cleanup(t, mnt)
		start := time.Now()
		r := harness.Run(t, "mount", "--key-file", key, filepath.Join(src, name), mnt)
		harness.WantError(t, "qcowfs mount "+name, r, name, why)
		if d := time.Since(start); d > 30*time.Second {
			t.Errorf("%s: the mount failed after %v", name, d)
		}
	}
}
