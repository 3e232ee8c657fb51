package remote

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
	"github.com/qcowfs/qcowfs/test/servers"
)

// A write of the overlay tests: n bytes of pattern b at off, through a
// mount, and with qemu-io into a local copy of the base.
type patternWrite struct {
	off, n int64
	b      byte
}

// overlayWrites straddle clusters, fill some, and overwrite the base's
// data and holes; then come writes at random places (a fixed seed: the
// same every run) of random lengths, up to 256 KiB, some overlapping.
var overlayWrites = append([]patternWrite{
	{0, 4096, 0xa1}, {64<<10 - 512, 1024, 0xa2}, {1 << 20, 3 << 20, 0xa3},
	{10<<20 + 4096, 100000, 0xa4}, {40<<20 - 7, 64 << 10, 0xa5},
}, randomWrites(34, 24, 64<<20)...)

// randomWrites are n writes of random lengths at random offsets of a
// disk of size bytes, each of its own pattern byte (0xc0 on).
func randomWrites(seed int64, n int, size int64) []patternWrite {
	r := rand.New(rand.NewSource(seed))
	var ws []patternWrite
	for i := range n {
		l := 1 + r.Int63n(256<<10)
		ws = append(ws, patternWrite{off: r.Int63n(size - l), n: l, b: byte(0xc0 + i)})
	}
	return ws
}

// serveBase makes the base (makeBase) in a folder that nginx serves, and
// returns it with its sha256 before the test and the server.
func serveBase(t *testing.T) (base string, before [32]byte, ng *servers.Nginx) {
	t.Helper()
	root := harness.SourceDir(t)
	base = makeBase(t, root)
	return base, sha(t, base), servers.StartNginx(t, root, false)
}

// makeBase makes dir/vm.qcow2, a 64 MiB qcow2 image with data of its own,
// and returns its path.
func makeBase(t testing.TB, dir string) string {
	t.Helper()
	return qemu.Make(t, filepath.Join(dir, "vm.qcow2"), "64M", "write -P 0x11 0 2M", "write -P 0x22 10M 3M", "write -P 0x23 40M 64k", "write -P 0x24 63M 1M")
}

// writeThrough writes ws into the raw file of a mount, then fsyncs it.
func writeThrough(t testing.TB, raw string, ws []patternWrite) {
	t.Helper()
	f := harness.OpenFile(t, raw, os.O_WRONLY)
	defer f.Close()
	for _, w := range ws {
		if _, err := f.WriteAt(bytes.Repeat([]byte{w.b}, int(w.n)), w.off); err != nil {
			t.Fatalf("write %d bytes at %d into %s: %v", w.n, w.off, raw, err)
		}
	}
	if err := f.Sync(); err != nil {
		t.Fatalf("fsync %s: %v", raw, err)
	}
}

// localCopy copies the base image and writes ws into it with qemu-io:
// what an overlay written the same way must read as.
func localCopy(t testing.TB, base, dst string, ws []patternWrite) string {
	t.Helper()
	qemu.Img(t, "convert", "-q", "-O", "qcow2", base, dst)
	var cmds []string
	for _, w := range ws {
		cmds = append(cmds, fmt.Sprintf("write -P %#x %d %d", w.b, w.off, w.n))
	}
	qemu.IO(t, dst, cmds...)
	return dst
}

func sha(t testing.TB, path string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}

// TestRemoteOverlayHTTP: --writable --overlay DIR over an image served by
// nginx. The first write makes DIR/vm.qcow2, whose backing file is the
// image's URL, format qcow2; qemu opens it as it is (its curl driver) and
// qemu-img compare finds it equal to a local copy of the base written the
// same way with qemu-io; qemu-img check is clean. The object on the server
// is byte-identical and only ever read (GETs). A second mount with the same
// DIR reads the writes back and appends to the same overlay. Then the base
// is replaced on the server: the overlay is not served, and the mount says
// so in one line naming the image, both versions and the flag; with
// --accept-changed-base it is served.
func TestRemoteOverlayHTTP(t *testing.T) {
	base, before, ng := serveBase(t)
	url := ng.URL + "/vm.qcow2"
	ov := filepath.Join(t.TempDir(), "overlays")
	work := t.TempDir()
	want := localCopy(t, base, filepath.Join(work, "local.qcow2"), overlayWrites)

	m := mountRemote(t, harness.Racy, url, "--writable", "--overlay", ov)
	raw := filepath.Join(m.Dir, "vm.raw")
	if st, err := os.Stat(raw); err != nil || st.Mode().Perm()&0o200 == 0 {
		t.Fatalf("vm.raw of a writable overlay mount: %v, mode %v; want owner write permission", err, st.Mode())
	}
	if _, err := os.Stat(filepath.Join(ov, "vm.qcow2")); !os.IsNotExist(err) {
		t.Errorf("an overlay exists before the first write (%v)", err)
	}
	writeThrough(t, raw, overlayWrites)
	harness.SameFile(t, raw, qemu.ToRaw(t, want, filepath.Join(work, "want.raw")))
	m.Unmount(t)

	o := filepath.Join(ov, "vm.qcow2")
	in := qemu.Info(t, o)
	if in["backing-filename"] != url || in["backing-filename-format"] != "qcow2" {
		t.Errorf("qemu-img info of the overlay: backing file %v, format %v; want %s, qcow2", in["backing-filename"], in["backing-filename-format"], url)
	}
	checkCleanCurl(t, o)
	// qemu reads the base over http itself (curl driver).
	if out, err := qemuCompare(t, o, want); err != nil {
		t.Errorf("qemu-img compare of the overlay with the local copy: %v\n%s", err, out)
	}
	if sha(t, base) != before {
		t.Errorf("the image on the server changed")
	}
	for _, a := range ng.Log(t) {
		if a.Method != "GET" && a.Method != "HEAD" {
			t.Errorf("nginx got %s %s: an overlay mount only reads", a.Method, a.URI)
		}
	}

	// Mounted again: the writes read back, and the next write goes
	// to the same overlay.
	m = mountRemote(t, harness.Daemon{}, url, "--writable", "--overlay", ov)
	raw = filepath.Join(m.Dir, "vm.raw")
	harness.SameFile(t, raw, filepath.Join(work, "want.raw"))
	more := []patternWrite{{20 << 20, 8192, 0xb1}}
	writeThrough(t, raw, more)
	m.Unmount(t)
	localCopy(t, base, filepath.Join(work, "local2.qcow2"), append(append([]patternWrite{}, overlayWrites...), more...))
	if out, err := qemuCompare(t, o, filepath.Join(work, "local2.qcow2")); err != nil {
		t.Errorf("qemu-img compare after the second mount: %v\n%s", err, out)
	}
	if n, _ := filepath.Glob(filepath.Join(ov, "*")); len(n) != 1 {
		t.Errorf("the overlay folder holds %v; want the one overlay", n)
	}

	// The base replaced on the server (nginx's ETag is its mtime and
	// size: a new time makes a new ETag).
	oldETag := etagOf(t, url)
	changeBase(t, base)
	later := time.Now().Add(10 * time.Second)
	os.Chtimes(base, later, later)
	newETag := etagOf(t, url)
	if oldETag == newETag {
		t.Fatalf("nginx's ETag did not change: %s", oldETag)
	}
	singleOverBase(t, harness.Daemon{}, url, url, oldETag, newETag, "--writable", "--overlay", ov)
	// Accepted, the overlay reads as the new base written the same way.
	m = mountRemote(t, harness.Daemon{}, url, "--writable", "--overlay", ov, "--accept-changed-base")
	accepted := localCopy(t, base, filepath.Join(work, "local3.qcow2"), append(append([]patternWrite{}, overlayWrites...), more...))
	harness.SameFile(t, filepath.Join(m.Dir, "vm.raw"), qemu.ToRaw(t, accepted, filepath.Join(work, "accepted.raw")))
	if log := m.LogText(t); !strings.Contains(log, "--accept-changed-base") {
		t.Errorf("the log does not say the overlay is served over another base:\n%s", log)
	}
}

// changeBase writes 64 KiB at 5 MiB of the base image, where no write
// of overlayWrites lands: an overlay served over the changed base shows
// the change.
func changeBase(t testing.TB, base string) {
	t.Helper()
	const off, n = 5 << 20, 64 << 10
	for _, w := range overlayWrites {
		if w.off < off+n && w.off+w.n > off {
			t.Fatalf("a write of overlayWrites (%d bytes at %d) lands where changeBase writes", w.n, w.off)
		}
	}
	qemu.IO(t, base, fmt.Sprintf("write -P 0x99 %d %d", off, n))
}

// qemuCompare runs qemu-img compare of a and b (qemu opening every
// backing file itself, over http too: curlQemu).
func qemuCompare(t testing.TB, a, b string) (string, error) {
	t.Helper()
	return curlQemu(t, "compare", "-U", a, b)
}

// etagOf is the ETag nginx gives url now.
func etagOf(t testing.TB, url string) string {
	t.Helper()
	out, err := execOut("curl", "-sfI", url)
	if err != nil {
		t.Fatalf("curl -I %s: %v", url, err)
	}
	for _, line := range strings.Split(out, "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.EqualFold(k, "etag") {
			return strings.TrimSpace(v)
		}
	}
	t.Fatalf("no ETag from %s:\n%s", url, out)
	return ""
}

// qemuJSON is a json: file name for qemu: the qcow2 overlay at path, its
// backing file the qcow2 image at url (a presigned URL, which qemu's curl
// driver opens where an s3:// one it cannot).
func qemuJSON(t testing.TB, path, url string) string {
	t.Helper()
	driver := strings.SplitN(url, ":", 2)[0]
	b, err := json.Marshal(map[string]any{
		"driver": "qcow2",
		"file":   map[string]any{"driver": "file", "filename": path},
		"backing": map[string]any{"driver": "qcow2",
			// (Both: with the url alone, qemu takes the backing
			// file name in the header for the URL.)
			"file": map[string]any{"driver": driver, "url": url, "filename": url}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return "json:" + string(b)
}

// TestRemoteOverlayS3: --writable --overlay DIR over a prefix of a
// versitygw bucket. The first write to deep/vm.raw makes DIR/deep/vm.qcow2,
// whose backing file is the object's s3:// URL: qemu-img info reads it,
// qemu cannot open it (no S3 signing), but given a presigned URL of the
// object as its backing file it reads the overlay as the local copy
// written the same way (qemu-img compare). Another image under the
// prefix, never written, has no overlay. The objects are unchanged; a
// second mount reads the writes back. The object replaced (new ETag): the
// overlay is refused, naming both; with --accept-changed-base it is served.
func TestRemoteOverlayS3(t *testing.T) {
	srv := startS3(t, "vms")
	work := qemu.TempDir(t)
	base := makeBase(t, work)
	other := filepath.Join(work, "other.qcow2")
	qemu.Create(t, "qcow2", other, "8M")
	putFile(t, srv, "vms", "fleet/deep/vm.qcow2", base)
	putFile(t, srv, "vms", "fleet/other.qcow2", other)
	env := s3Env(t, srv.Access, srv.Secret)
	ov := filepath.Join(t.TempDir(), "overlays")
	want := localCopy(t, base, filepath.Join(work, "local.qcow2"), overlayWrites)
	wantRaw := qemu.ToRaw(t, want, filepath.Join(work, "want.raw"))

	m := mountRemote(t, harness.Daemon{Env: env, Racy: true}, "s3://vms/fleet/", "--s3-endpoint", srv.Endpoint, "--writable", "--overlay", ov)
	raw := filepath.Join(m.Dir, "deep", "vm.raw")
	writeThrough(t, raw, overlayWrites)
	harness.SameFile(t, raw, wantRaw)
	m.Unmount(t)

	o := filepath.Join(ov, "deep", "vm.qcow2")
	in := qemu.Info(t, o)
	if in["backing-filename"] != "s3://vms/fleet/deep/vm.qcow2" || in["backing-filename-format"] != "qcow2" {
		t.Errorf("qemu-img info of the overlay: backing file %v, format %v", in["backing-filename"], in["backing-filename-format"])
	}
	if _, err := os.Stat(filepath.Join(ov, "other.qcow2")); !os.IsNotExist(err) {
		t.Errorf("an image never written has an overlay (%v)", err)
	}
	if out, err := qemuCompare(t, o, want); err == nil || !strings.Contains(out, "Unknown protocol 's3'") {
		t.Errorf("qemu-img compare of an overlay whose backing file is an s3:// URL: %v %s; want qemu's unknown protocol", err, out)
	}
	// Nor, with qemu 7.2, through a presigned URL: its curl driver
	// asks with HEAD first, which a signature for GET does not allow
	// (what the README says; a qemu that can is no failure).
	presigned := srv.Presign(t, "vms", "fleet/deep/vm.qcow2")
	out, err := qemuCompare(t, qemuJSON(t, o, presigned), want)
	t.Logf("qemu-img compare of the overlay over a presigned URL of its base: %v %s", err, out)
	// A copy of the overlay rebased (-u: the name only) onto a download
	// of the object is what qemu reads.
	got := readObject(t, srv, "vms", "fleet/deep/vm.qcow2")
	if b, _ := os.ReadFile(base); !bytes.Equal(got, b) {
		t.Errorf("the object changed")
	}
	dl := filepath.Join(work, "download.qcow2")
	if err := os.WriteFile(dl, got, 0o644); err != nil {
		t.Fatal(err)
	}
	cp := filepath.Join(work, "overlay-copy.qcow2")
	if out, err := execOut("cp", o, cp); err != nil {
		t.Fatalf("cp: %v %s", err, out)
	}
	qemu.Img(t, "rebase", "-u", "-b", dl, "-F", "qcow2", cp)
	qemu.CheckClean(t, cp)
	if out, err := qemuCompare(t, cp, want); err != nil {
		t.Errorf("qemu-img compare of the overlay (rebased onto a download of its base) with the local copy: %v\n%s", err, out)
	}

	m = mountRemote(t, harness.Daemon{Env: env}, "s3://vms/fleet/", "--s3-endpoint", srv.Endpoint, "--writable", "--overlay", ov)
	harness.SameFile(t, filepath.Join(m.Dir, "deep", "vm.raw"), wantRaw)
	m.Unmount(t)

	oldETag, _ := srv.Put(t, "vms", "fleet/deep/vm.qcow2", got) // the same bytes again: the same ETag
	changeBase(t, base)
	b, err := os.ReadFile(base)
	if err != nil {
		t.Fatal(err)
	}
	newETag, _ := srv.Put(t, "vms", "fleet/deep/vm.qcow2", b)
	m = mountRemote(t, harness.Daemon{Env: env}, "s3://vms/fleet/", "--s3-endpoint", srv.Endpoint, "--writable", "--overlay", ov)
	refusedOverBase(t, m, "s3://vms/fleet/deep/vm.qcow2", oldETag, newETag, "deep/vm.raw")
	if _, err := os.Stat(filepath.Join(m.Dir, "other.raw")); err != nil {
		t.Errorf("other.raw beside a refused overlay: %v", err)
	}
	m.Unmount(t)
	m = mountRemote(t, harness.Daemon{Env: env}, "s3://vms/fleet/", "--s3-endpoint", srv.Endpoint, "--writable", "--overlay", ov, "--accept-changed-base")
	accepted := localCopy(t, base, filepath.Join(work, "local3.qcow2"), overlayWrites)
	harness.SameFile(t, filepath.Join(m.Dir, "deep", "vm.raw"), qemu.ToRaw(t, accepted, filepath.Join(work, "accepted.raw")))
}

// singleOverBase checks that the mount of one image, src, by d with args
// fails when its overlay's base changed: non-zero, nothing mounted, one
// line naming the base (name), both versions and --accept-changed-base,
// as README says of a single image that is not shown. (A prefix mounts
// and says so: refusedOverBase.)
func singleOverBase(t *testing.T, d harness.Daemon, src, name, oldV, newV string, args ...string) {
	t.Helper()
	m, out, err := tryMountRemote(t, d, src, args...)
	if err == nil {
		t.Errorf("the single image %s mounted over a changed base (%s); want a failure", src, m.Dir)
		return
	}
	out = strings.TrimSpace(out)
	t.Logf("the mount over a changed base says: %s", out)
	if strings.Count(out, "\n") != 0 || !strings.HasPrefix(out, "qcowfs: ") || !strings.Contains(out, name) || !strings.Contains(out, oldV) || !strings.Contains(out, newV) || !strings.Contains(out, "--accept-changed-base") {
		t.Errorf("mount over a changed base says %q; want one line naming %s, both versions (%s, %s) and --accept-changed-base", out, name, oldV, newV)
	}
}

// readObject reads bucket/key whole.
func readObject(t testing.TB, srv *servers.S3Server, bucket, key string) []byte {
	t.Helper()
	url := srv.Presign(t, bucket, key)
	out, err := exec.Command("curl", "-sf", url).Output()
	if err != nil {
		t.Fatalf("curl %s/%s: %v", bucket, key, err)
	}
	return out
}

// TestRemoteOverlayGuest: the ext4 in the partition of an image served by
// nginx, loop-mounted writable through an overlay mount (disk.raw.parts/p1):
// files written, changed and removed. Then qemu reads the overlay over
// http (qemu-img convert, curl driver): e2fsck -f finds the file system
// clean, and it holds the files as the guest left them.
func TestRemoteOverlayGuest(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "sfdisk", "mkfs.ext4", "e2fsck", "losetup", "partx", "mount")
	work := qemu.TempDir(t)
	harness.WriteGuestTree(t, filepath.Join(work, "tree"))
	disk := harness.MakeGuestDisk(t, work, filepath.Join(work, "tree"))
	root := qemu.TempDir(t)
	qemu.Img(t, "convert", "-q", "-f", "raw", "-O", "qcow2", disk, filepath.Join(root, "disk.qcow2"))
	before := sha(t, filepath.Join(root, "disk.qcow2"))
	ng := servers.StartNginx(t, root, false)
	ov := filepath.Join(t.TempDir(), "overlays")

	m := mountRemote(t, harness.Racy, ng.URL+"/disk.qcow2", "--writable", "--overlay", ov)
	dev, detach := harness.AttachLoop(t, filepath.Join(m.Dir, "disk.raw.parts", "p1"))
	guest, umount := harness.MountGuest(t, dev, "")
	for i := range 20 {
		name := filepath.Join(guest, "new", fmt.Sprintf("f%02d.bin", i))
		os.MkdirAll(filepath.Dir(name), 0o755)
		if err := os.WriteFile(name, bytes.Repeat([]byte{byte(i)}, 1000*i+17), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(guest, "a/b/c/deep.txt"), []byte("changed through an overlay\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(guest, "a/b/c/d/deeper.bin")); err != nil {
		t.Fatal(err)
	}
	want := harness.ReadTree(t, guest)
	umount()
	detach()
	m.Unmount(t)
	if sha(t, filepath.Join(root, "disk.qcow2")) != before {
		t.Errorf("the image on the server changed")
	}

	o := filepath.Join(ov, "disk.qcow2")
	checkCleanCurl(t, o)
	full := filepath.Join(work, "full.raw") // qemu reads the base over http
	if out, err := curlQemu(t, "convert", "-O", "raw", o, full); err != nil {
		t.Fatalf("qemu-img convert of the overlay: %v\n%s", err, out)
	}
	dev, _ = harness.AttachLoop(t, full, "-r", "-P")
	part := harness.PartitionNode(t, dev)
	if out, err := execOut("e2fsck", "-f", "-n", part); err != nil {
		t.Errorf("e2fsck -f -n of the guest file system, as qemu reads the overlay: %v\n%s", err, out)
	}
	ro, _ := harness.MountGuest(t, part, "ro,noload")
	harness.CompareTrees(t, harness.ReadTree(t, ro), want)
}

// TestRemoteOverlayChain: an overlay over a remote image whose own backing
// file is remote (sub/top.qcow2 over ../base.qcow2 on nginx). qemu opens
// the overlay's chain over http to the bottom (qemu-img compare with a
// local copy written the same way). The base of the chain replaced on the
// server, top unchanged: the overlay is refused, naming the base's URL and
// both its versions; with --accept-changed-base it is served.
func TestRemoteOverlayChain(t *testing.T) {
	root := harness.SourceDir(t)
	top := makeChain(t, root)
	ng := servers.StartNginx(t, root, false)
	url, baseURL := ng.URL+"/sub/top.qcow2", ng.URL+"/base.qcow2"
	allow := "--allow-backing-outside=" + ng.URL + "/"
	ov := filepath.Join(t.TempDir(), "overlays")
	work := t.TempDir()
	want := localCopy(t, top, filepath.Join(work, "local.qcow2"), overlayWrites)

	m := mountRemote(t, harness.Daemon{}, url, "--writable", "--overlay", ov, allow)
	writeThrough(t, filepath.Join(m.Dir, "top.raw"), overlayWrites)
	m.Unmount(t)
	o := filepath.Join(ov, "top.qcow2")
	checkCleanCurl(t, o)
	if out, err := qemuCompare(t, o, want); err != nil {
		t.Errorf("qemu-img compare of the overlay over a remote chain with the local copy: %v\n%s", err, out)
	}

	oldETag := etagOf(t, baseURL)
	base := filepath.Join(root, "base.qcow2")
	changeBase(t, base)
	later := time.Now().Add(10 * time.Second)
	os.Chtimes(base, later, later)
	newETag := etagOf(t, baseURL)
	singleOverBase(t, harness.Daemon{}, url, baseURL, oldETag, newETag, "--writable", "--overlay", ov, allow)
	m = mountRemote(t, harness.Daemon{}, url, "--writable", "--overlay", ov, allow, "--accept-changed-base")
	accepted := localCopy(t, top, filepath.Join(work, "accepted.qcow2"), overlayWrites)
	harness.SameFile(t, filepath.Join(m.Dir, "top.raw"), qemu.ToRaw(t, accepted, filepath.Join(work, "accepted.raw")))
}

// TestRemoteTempOverlay: throwaway overlays (--writable --overlay=temp)
// over an image on nginx, without --cache-dir: writes read back as the
// base written the same way (qemu-io into a local copy); the folder of
// overlays, which qcowfs status names, holds the one image written, and
// qemu reads that overlay over http as the local copy (qemu-img compare
// -U after fsync); nginx only served reads, and its file is unchanged.
// After unmount the folder is gone, and the next mount reads the
// original.
func TestRemoteTempOverlay(t *testing.T) {
	base, before, ng := serveBase(t)
	url := ng.URL + "/vm.qcow2"
	t.Setenv("TMPDIR", t.TempDir()) // the daemons' and qcowfs unmount's
	work := t.TempDir()
	want := localCopy(t, base, filepath.Join(work, "local.qcow2"), overlayWrites)

	m := mountRemote(t, harness.Racy, url, "--writable", "--overlay=temp")
	st, out := harness.StatusOf(t, m.Dir)
	if !st.TempOverlay || !strings.HasPrefix(st.Overlay, os.Getenv("TMPDIR")+"/") {
		t.Fatalf("qcowfs status: overlay %q, temp %v; want a throwaway folder under $TMPDIR\n%s", st.Overlay, st.TempOverlay, out)
	}
	raw := filepath.Join(m.Dir, "vm.raw")
	writeThrough(t, raw, overlayWrites)
	harness.SameFile(t, raw, qemu.ToRaw(t, want, filepath.Join(work, "want.raw")))
	if names, _ := filepath.Glob(filepath.Join(st.Overlay, "*")); len(names) != 1 || filepath.Base(names[0]) != "vm.qcow2" {
		t.Errorf("the folder of throwaway overlays holds %v; want vm.qcow2", names)
	}
	if out, err := qemuCompare(t, filepath.Join(st.Overlay, "vm.qcow2"), want); err != nil {
		t.Errorf("qemu-img compare of the throwaway overlay with the local copy: %v\n%s", err, out)
	}
	m.Unmount(t)
	if _, err := os.Lstat(st.Overlay); !os.IsNotExist(err) {
		t.Errorf("the folder of throwaway overlays %s is still there after unmount (%v)", st.Overlay, err)
	}
	if sha(t, base) != before {
		t.Errorf("the image on the server changed")
	}
	for _, a := range ng.Log(t) {
		if a.Method != "GET" && a.Method != "HEAD" {
			t.Errorf("nginx got %s %s: an overlay mount only reads", a.Method, a.URI)
		}
	}
	m = mountRemote(t, harness.Daemon{}, url, "--writable", "--overlay=temp")
	harness.SameFile(t, filepath.Join(m.Dir, "vm.raw"), wantRaw(t, work, base))
}

// TestRemoteOverlayS3Version: an overlay over a single object of a
// versioned bucket records its version id, not its ETag: the same bytes
// stored again (the same ETag, a new version id) are another base. The
// mount of the object (not a prefix) makes DIR/vm.qcow2; the remount
// reads the writes; after the new PUT the overlay is refused, the line
// naming both version ids; --accept-changed-base serves it.
func TestRemoteOverlayS3Version(t *testing.T) {
	harness.RequireFUSE(t)
	srv := servers.StartVersityWith(t, t.TempDir(), "qcowfs-test-access", "qcowfs-test-secret-0123456789", servers.VersityOptions{Versioning: true})
	srv.MakeBucket(t, "vbucket", true)
	work := qemu.TempDir(t)
	base := makeBase(t, work)
	b, err := os.ReadFile(base)
	if err != nil {
		t.Fatal(err)
	}
	etag, v1 := srv.Put(t, "vbucket", "img/vm.qcow2", b)
	if v1 == "" {
		t.Fatal("versitygw gave no version id in a versioned bucket")
	}
	env := s3Env(t, srv.Access, srv.Secret)
	ov := filepath.Join(t.TempDir(), "overlays")
	want := qemu.ToRaw(t, localCopy(t, base, filepath.Join(work, "local.qcow2"), overlayWrites), filepath.Join(work, "want.raw"))
	src := "s3://vbucket/img/vm.qcow2"
	mount := func(extra ...string) *harness.Mounted {
		return mountRemote(t, harness.Daemon{Env: env}, src, append([]string{"--s3-endpoint", srv.Endpoint, "--writable", "--overlay", ov}, extra...)...)
	}

	m := mount()
	writeThrough(t, filepath.Join(m.Dir, "vm.raw"), overlayWrites)
	m.Unmount(t)
	o := filepath.Join(ov, "vm.qcow2")
	if in := qemu.Info(t, o); in["backing-filename"] != src {
		t.Errorf("qemu-img info of the overlay: backing file %v, want %s", in["backing-filename"], src)
	}
	m = mount()
	harness.SameFile(t, filepath.Join(m.Dir, "vm.raw"), want)
	m.Unmount(t)

	etag2, v2 := srv.Put(t, "vbucket", "img/vm.qcow2", b)
	if etag2 != etag || v2 == v1 {
		t.Fatalf("the same bytes stored again: ETag %s then %s, version %s then %s; want the same ETag, another version", etag, etag2, v1, v2)
	}
	singleOverBase(t, harness.Daemon{Env: env}, src, src, v1, v2, "--s3-endpoint", srv.Endpoint, "--writable", "--overlay", ov)
	m = mount("--accept-changed-base")
	harness.SameFile(t, filepath.Join(m.Dir, "vm.raw"), want)
}

// refusedOverBase checks a mount whose overlay's base changed: it said one
// line naming the base (name), both versions and --accept-changed-base,
// and does not show the image's file raw (relative to the mount).
func refusedOverBase(t *testing.T, m *harness.Mounted, name, oldV, newV, raw string) {
	t.Helper()
	out := strings.TrimSpace(m.Said)
	t.Logf("the mount over a changed base says: %s", out)
	if strings.Count(out, "\n") != 0 || !strings.Contains(out, name) || !strings.Contains(out, oldV) || !strings.Contains(out, newV) || !strings.Contains(out, "--accept-changed-base") {
		t.Errorf("mount over a changed base says %q; want one line naming %s, both versions (%s, %s) and --accept-changed-base", out, name, oldV, newV)
	}
	if _, err := os.Stat(filepath.Join(m.Dir, raw)); !os.IsNotExist(err) {
		t.Errorf("%s shown over a changed base (%v)", raw, err)
	}
}
