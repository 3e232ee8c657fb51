package remote

// Images over HTTP(S) (nginx) and S3 (versitygw) read through a mount and
// through info, map and check as qemu reads them over curl.

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
	"github.com/qcowfs/qcowfs/test/servers"
)

// TestRemoteHTTPMatchesQemu serves the read matrix with nginx and mounts
// every image by its http:// URL: the bytes through the mount are qemu-img
// convert's, and lseek SEEK_DATA/SEEK_HOLE finds the data qemu-img map of
// the URL finds (qemu's curl driver, which like us knows no host holes of
// a remote file; a local mount also reports the image file's holes inside
// allocated clusters, as qemu does for local files). The chain images read their backing files from
// the server. Images whose data file qemu recorded as an absolute local
// path are refused: a remote image never gets a local file opened.
func TestRemoteHTTPMatchesQemu(t *testing.T) {
	root := harness.SourceDir(t)
	src := filepath.Join(root, "m")
	if err := os.Mkdir(src, 0o755); err != nil {
		t.Fatal(err)
	}
	images := qemu.Matrix(t, src)
	ng := servers.StartNginx(t, root, false)
	expect := t.TempDir()
	for _, im := range images {
		t.Run(im.Name, func(t *testing.T) {
			url := ng.URL + "/m/" + filepath.Base(im.Path)
			if df := dataFileName(t, im.Path); strings.HasPrefix(df, "/") {
				_, out, err := tryMountRemote(t, harness.Daemon{}, url)
				if err == nil || !strings.Contains(out, "outside the allowed URL prefixes") {
					t.Fatalf("mounting an image whose data file is the local path %s: err %v, output %q; want a refusal", df, err, out)
				}
				return
			}
			m := mountRemote(t, harness.Daemon{}, url)
			got := filepath.Join(m.Dir, im.Name+".raw")
			want := wantRaw(t, expect, im.Path)
			harness.SameFile(t, got, want)
			// df: the one object mounted.
			if st, err := os.Stat(im.Path); err != nil {
				t.Fatal(err)
			} else {
				checkRemoteDf(t, m.Dir, st.Size(), 1)
			}
			// Mapped, the file reads the same.
			sameMapped(t, got, want)
			// lseek answers as qemu's block status of the URL (its
			// curl driver): a remote object has no host holes, so
			// every allocated cluster is data.
			if r, q := harness.FileRuns(t, got), qemu.DataRuns(t, url); !reflect.DeepEqual(r, q) {
				t.Errorf("lseek data runs through the mount %v; qemu-img map of the URL %v", r, q)
			}
		})
	}
}

// dataFileName is the external data file an image names, "" if none.
func dataFileName(t testing.TB, image string) string {
	fs, _ := qemu.Info(t, image)["format-specific"].(map[string]any)
	data, _ := fs["data"].(map[string]any)
	name, _ := data["data-file"].(string)
	return name
}

// makeChain makes dir/base.qcow2 <- dir/sub/top.qcow2 (the backing file
// named "../base.qcow2"), each with data of its own, and returns the top.
func makeChain(t testing.TB, dir string) string {
	t.Helper()
	if err := os.MkdirAll(filepath.Join(dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	qemu.Make(t, filepath.Join(dir, "base.qcow2"), "64M", "write -P 0x11 0 1M", "write -P 0x22 10M 3M", "write -P 0x23 40M 64k")
	top := filepath.Join(dir, "sub", "top.qcow2")
	qemu.Create(t, "qcow2", top, "64M", "-b", "../base.qcow2", "-F", "qcow2")
	qemu.IO(t, top, "write -P 0x33 512k 1M", "write -z 11M 64k", "write -P 0x34 60M 100000")
	return top
}

// TestRemoteHTTPS reads a backing chain across two folders of an nginx
// over TLS, its certificate from a CA made by the test: with --ca-file the
// bytes are qemu's; without it the mount fails with a certificate error
// and leaves nothing mounted. qcowfs info, map and check read the same URL.
func TestRemoteHTTPS(t *testing.T) {
	root := harness.SourceDir(t)
	top := makeChain(t, root)
	ng := servers.StartNginx(t, root, true)
	url := ng.URL + "/sub/top.qcow2"

	if _, out, err := tryMountRemote(t, harness.Daemon{}, url); err == nil || !strings.Contains(out, "certificate") {
		t.Errorf("mount without --ca-file: err %v, output %q; want a certificate error", err, out)
	}

	// The backing file is in the parent folder: outside the image's
	// folder, so it needs allowing.
	if _, out, err := tryMountRemote(t, harness.Daemon{}, url, "--ca-file", ng.CAFile); err == nil ||
		!strings.Contains(out, "outside the allowed URL prefixes") || !strings.Contains(out, "--allow-backing-outside="+ng.URL+"/") {
		t.Errorf("mount with the backing file outside the image's folder: err %v, output %q; want a refusal with a hint", err, out)
	}
	m := mountRemote(t, harness.Daemon{}, url, "--ca-file", ng.CAFile, "--allow-backing-outside="+ng.URL+"/")
	harness.SameFile(t, filepath.Join(m.Dir, "top.raw"), wantRaw(t, t.TempDir(), top))

	// info, map and check accept the URL; map's extents are qemu's.
	if r := harness.Run(t, "info", "--ca-file", ng.CAFile, url); r.Code != 0 || !strings.Contains(r.Stdout, "virtual size: 64 MiB") {
		t.Errorf("qcowfs info %s: exit status %d\n%s%s", url, r.Code, r.Stdout, r.Stderr)
	}
	if r := harness.Run(t, "check", "--ca-file", ng.CAFile, ng.URL+"/base.qcow2"); r.Code != 0 || !strings.Contains(r.Stdout, "No errors were found") {
		t.Errorf("qcowfs check: exit status %d\n%s%s", r.Code, r.Stdout, r.Stderr)
	}
	r := harness.Run(t, "map", "--output=json", "--ca-file", ng.CAFile, ng.URL+"/base.qcow2")
	harness.WantOK(t, "qcowfs map", r)
	var got []qemu.MapEntry
	r.JSON(t, &got)
	if want := qemu.Map(t, filepath.Join(root, "base.qcow2")); !reflect.DeepEqual(got, want) {
		t.Errorf("qcowfs map of the URL:\n%+v\nqemu-img map of the file:\n%+v", got, want)
	}

	// The top's chain leaves its folder: info, map and check confine
	// it as the mount does, and --allow-backing-outside (URL prefixes
	// only) follows it.
	for _, cmd := range [][]string{{"map", "--output=json"}, {"check"}, {"info", "--backing-chain"}} {
		args := append(append([]string{}, cmd...), "--ca-file", ng.CAFile, url)
		r := harness.Run(t, args...)
		if out := r.Stdout + r.Stderr; r.Code == 0 || !strings.Contains(out, "outside") || !strings.Contains(out, "--allow-backing-outside") {
			t.Errorf("qcowfs %s of a chain leaving the image's folder: exit status %d, output %q; want a refusal with a hint", cmd[0], r.Code, out)
		}
	}
	allow := "--allow-backing-outside=" + ng.URL + "/"
	r = harness.Run(t, "map", "--output=json", "--ca-file", ng.CAFile, allow, url)
	harness.WantOK(t, "qcowfs map "+allow+" of the chain", r)
	got = nil
	r.JSON(t, &got)
	if want := qemu.Map(t, top); !reflect.DeepEqual(got, want) {
		t.Errorf("qcowfs map of the chain's URL:\n%+v\nqemu-img map of the file:\n%+v", got, want)
	}
	if r := harness.Run(t, "check", "--ca-file", ng.CAFile, allow, url); r.Code != 0 || !strings.Contains(r.Stdout, "No errors were found") {
		t.Errorf("qcowfs check %s of the chain: exit status %d\n%s%s", allow, r.Code, r.Stdout, r.Stderr)
	}
	if r := harness.Run(t, "info", "--backing-chain", "--ca-file", ng.CAFile, allow, url); r.Code != 0 || strings.Count(r.Stdout, "virtual size: 64 MiB") != 2 {
		t.Errorf("qcowfs info --backing-chain %s: exit status %d\n%s%s", allow, r.Code, r.Stdout, r.Stderr)
	}
	if r := harness.Run(t, "map", "--allow-backing-outside="+root, url); r.Code != 2 {
		t.Errorf("qcowfs map --allow-backing-outside=LOCAL-DIR: exit status %d, want 2", r.Code)
	}
}

// TestRemoteInfoMatchesQemu: qcowfs info, map and check of http:// URLs (a
// chain in one folder of an nginx) print what qemu-img prints through its
// curl driver, in both formats: "disk size: unavailable" and no
// actual-size, as qemu cannot tell a remote file's size on disk either.
func TestRemoteInfoMatchesQemu(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	root := qemu.TempDir(t)
	qemu.Make(t, filepath.Join(root, "base.qcow2"), "64M", "write -P 0x11 0 1M", "write -P 0x22 10M 3M")
	top := filepath.Join(root, "top.qcow2")
	qemu.Create(t, "qcow2", top, "64M", "-b", "base.qcow2", "-F", "qcow2")
	qemu.IO(t, top, "write -P 0x33 512k 1M", "write -z 11M 64k")
	ng := servers.StartNginx(t, root, false)
	for _, url := range []string{ng.URL + "/top.qcow2", ng.URL + "/base.qcow2"} {
		for _, out := range []string{"human", "json"} {
			for _, cmd := range [][]string{{"info"}, {"info", "--backing-chain"}, {"map"}, {"check"}} {
				args := append(append([]string{}, cmd...), "--output="+out, url)
				q, us := harness.Both(t, root, args...)
				harness.SameAsQemu(t, strings.Join(args, " "), q, us)
			}
		}
	}
}

// TestRemoteNoLocalFiles: an image on a server naming a local file (an
// absolute path that exists here, a file: name) is refused, even with
// --allow-backing-outside naming the local folder; --writable without
// --overlay is refused with a remote source (its writes go to overlays).
func TestRemoteNoLocalFiles(t *testing.T) {
	root := harness.SourceDir(t)
	if err := os.Mkdir(filepath.Join(root, "m"), 0o755); err != nil {
		t.Fatal(err)
	}
	local := filepath.Join(t.TempDir(), "local-base.qcow2")
	qemu.Create(t, "qcow2", local, "8M")
	for _, name := range []string{local, "file:" + local} {
		qemu.Create(t, "qcow2", filepath.Join(root, "m", "top.qcow2"), "8M", "-b", name, "-F", "qcow2", "-u")
		ng := servers.StartNginx(t, root, false)
		_, out, err := tryMountRemote(t, harness.Daemon{}, ng.URL+"/m/top.qcow2", "--allow-backing-outside="+filepath.Dir(local))
		if err == nil || !strings.Contains(out, "refused") {
			t.Errorf("backing file %q: err %v, output %q; want a refusal", name, err, out)
		}
	}
	qemu.Create(t, "qcow2", filepath.Join(root, "plain.qcow2"), "8M")
	ng := servers.StartNginx(t, root, false)
	if _, out, err := tryMountRemote(t, harness.Daemon{}, ng.URL+"/plain.qcow2", "--writable"); err == nil || !strings.Contains(out, "--overlay") {
		t.Errorf("--writable with a URL and no --overlay: err %v, output %q; want a refusal naming --overlay", err, out)
	}
}

// TestRemoteSparseCopy copies a sparse 1 GiB image out of the mount with
// cp --sparse=always: the copy is qemu's, and what nginx sent (its access
// log, every request the daemon counted) is at most 1.1 times the bytes
// the image file allocates: holes are answered from metadata, and no data
// range is fetched twice.
func TestRemoteSparseCopy(t *testing.T) {
	root := harness.SourceDir(t)
	img := qemu.Make(t, filepath.Join(root, "sparse.qcow2"), "1G", "write -P 0x41 0 1M", "write -P 0x42 300M 2M", "write -P 0x43 700M 512k", "write -P 0x44 1023M 64k")
	var st unix.Stat_t
	if err := unix.Stat(img, &st); err != nil {
		t.Fatal(err)
	}
	allocated := st.Blocks * 512
	ng := servers.StartNginx(t, root, false)
	m := mountRemote(t, harness.Daemon{}, ng.URL+"/sparse.qcow2")
	out := filepath.Join(t.TempDir(), "out.raw")
	harness.WantOK(t, "cp", harness.Exec(t, "cp", "--sparse=always", filepath.Join(m.Dir, "sparse.raw"), out))
	harness.SameFile(t, out, wantRaw(t, t.TempDir(), img))
	// The daemon's counters: the mount command's own check of the
	// image before mounting (its header and tables) is not the copy's.
	stats := remoteStats(t, m)
	log := ng.WaitLog(t, int(stats.Requests))
	t.Logf("image file allocates %d bytes; the daemon fetched %d in %d requests; nginx sent %d in %d requests in all",
		allocated, stats.Bytes, stats.Requests, servers.BodyBytes(log), len(log))
	if stats.Bytes > allocated*11/10 {
		t.Errorf("the daemon fetched %d bytes for a copy of an image allocating %d (limit 1.1x)", stats.Bytes, allocated)
	}
	for _, a := range log {
		if a.Status != 206 {
			t.Errorf("nginx answered %d to %s %s (Range %q): every request should be a range", a.Status, a.Method, a.URI, a.Range)
		}
	}
	if err := unix.Stat(out, &st); err != nil {
		t.Fatal(err)
	}
	if st.Blocks*512 > 4<<20 {
		t.Errorf("the copy allocates %d bytes; cp --sparse=always should have kept the holes", st.Blocks*512)
	}
}

// TestRemoteURLCredentials: a password in an image's URL reaches the
// server, and nothing else: not the mount table, the daemon's log, its
// status, or the error of a failed mount.
func TestRemoteURLCredentials(t *testing.T) {
	root := harness.SourceDir(t)
	img := qemu.Make(t, filepath.Join(root, "vm.qcow2"), "8M", "write -P 0x42 1M 1M")
	ng := servers.StartNginx(t, root, false)
	const password = "s3cr3t-pa55word"
	withPass := strings.Replace(ng.URL, "://", "://user:"+password+"@", 1)

	_, out, err := tryMountRemote(t, harness.Daemon{}, withPass+"/missing.qcow2")
	if err == nil || strings.Contains(out, password) {
		t.Errorf("mount of a missing object: err %v, output %q; want a failure without the password", err, out)
	}
	m := mountRemote(t, harness.Daemon{}, withPass+"/vm.qcow2")
	harness.SameFile(t, filepath.Join(m.Dir, "vm.raw"), wantRaw(t, t.TempDir(), img))
	status := harness.Run(t, "status", "--output=json", m.Dir).Stdout
	mounts, _ := os.ReadFile("/proc/self/mountinfo")
	for what, text := range map[string]string{"the log": m.LogText(t), "qcowfs status": status, "the mount table": string(mounts)} {
		if strings.Contains(text, password) {
			t.Errorf("%s shows the URL's password", what)
		}
	}
}

// sameMapped fails the test unless file, mapped read-only, holds the bytes
// of the file want.
func sameMapped(t *testing.T, file, want string) {
	t.Helper()
	w, err := os.ReadFile(want)
	if err != nil {
		t.Fatal(err)
	}
	f := harness.Open(t, file)
	defer f.Close()
	if len(w) == 0 {
		return
	}
	b, err := unix.Mmap(int(f.Fd()), 0, len(w), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatalf("mmap %s: %v", file, err)
	}
	defer unix.Munmap(b)
	if !bytes.Equal(b, w) {
		t.Errorf("%s mapped differs from %s", file, want)
	}
}

// TestRemoteS3 mounts a prefix of a versitygw bucket: its qcow2 objects
// appear in folders mirroring their keys (nested prefixes, a backing chain
// across them), other objects and other prefixes do not; an object put
// while mounted appears within the refresh interval; every raw file reads
// as qemu-img convert of the file uploaded; an object replaced shows its
// new content after the next refresh. A wrong secret key fails the
// mount with a clear error, a non-zero exit, nothing mounted, and neither
// secret appears in any message or log.
func TestRemoteS3(t *testing.T) {
	harness.RequireFUSE(t)
	srv := startS3(t, "images")
	work := qemu.TempDir(t)
	img := func(name, size string, cmds ...string) string {
		p := filepath.Join(work, name)
		os.MkdirAll(filepath.Dir(p), 0o755)
		qemu.Create(t, "qcow2", p, size)
		qemu.IO(t, p, cmds...)
		return p
	}
	a := img("a.qcow2", "8M", "write -P 0x61 0 1M", "write -P 0x62 5M 64k")
	b := img("deep/b.qcow2", "16M", "write -P 0x63 1M 2M")
	c := filepath.Join(work, "deep/er/c.qcow2")
	os.MkdirAll(filepath.Dir(c), 0o755)
	qemu.Create(t, "qcow2", c, "16M", "-b", "../b.qcow2", "-F", "qcow2")
	qemu.IO(t, c, "write -P 0x64 2M 100000")
	notes := filepath.Join(work, "notes.txt")
	os.WriteFile(notes, []byte("not an image\n"), 0o644)
	for key, path := range map[string]string{
		"vms/a.qcow2": a, "vms/deep/b.qcow2": b, "vms/deep/er/c.qcow2": c, "vms/notes.txt": notes,
		"other/x.qcow2": a, "vms2/y.qcow2": a,
	} {
		putFile(t, srv, "images", key, path)
	}
	env := s3Env(t, srv.Access, srv.Secret)

	// A wrong secret: refused before anything is mounted.
	wrong := s3Env(t, srv.Access, "wrong-secret-key-0123456789")
	_, out, err := tryMountRemote(t, harness.Daemon{Env: wrong}, "s3://images/vms/", "--s3-endpoint", srv.Endpoint)
	if err == nil || !strings.Contains(out, "access denied") {
		t.Errorf("mount with a wrong secret key: err %v, output %q; want an access denied error", err, out)
	}
	if strings.Contains(out, "wrong-secret-key") || strings.Contains(out, srv.Secret) {
		t.Errorf("the mount's error shows a secret key: %q", out)
	}

	// The endpoint as an -o option, as in fstab.
	m := mountRemote(t, harness.Daemon{Env: env, Racy: true}, "s3://images/vms/", "-o", "s3_endpoint="+srv.Endpoint+",remote_refresh=1s")
	for dir, want := range map[string][]string{"": {"a.raw", "deep"}, "deep": {"b.raw", "er"}, "deep/er": {"c.raw"}} {
		if got := harness.Names(t, filepath.Join(m.Dir, dir)); !reflect.DeepEqual(got, want) {
			t.Errorf("folder %q of the mount lists %q, want %q", dir, got, want)
		}
	}
	expect := t.TempDir()
	for raw, image := range map[string]string{"a.raw": a, "deep/b.raw": b, "deep/er/c.raw": c} {
		harness.SameFile(t, filepath.Join(m.Dir, raw), wantRaw(t, t.TempDir(), image))
	}

	// df: the objects under the prefix (images or not), their bytes as
	// the size, all used.
	var stored int64
	for _, p := range []string{a, b, c, notes} {
		st, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		stored += st.Size()
	}
	checkRemoteDf(t, m.Dir, stored, 4)

	// Put while mounted: shown within the refresh interval (1 s), give
	// or take a lookup.
	n := img("new.qcow2", "4M", "write -P 0x65 0 3M")
	putFile(t, srv, "images", "vms/deep/new.qcow2", n)
	put := time.Now()
	harness.WaitFor(t, "the new object to appear", 5*time.Second, func() bool {
		_, err := os.Stat(filepath.Join(m.Dir, "deep", "new.raw"))
		return err == nil
	})
	if d := time.Since(put); d > 2500*time.Millisecond {
		t.Errorf("the new object appeared after %v; the refresh interval is 1s", d)
	}
	harness.SameFile(t, filepath.Join(m.Dir, "deep", "new.raw"), wantRaw(t, expect, n))

	// Replaced while mounted (and not open): the next listing shows the
	// new version, a new file with the new size and bytes.
	putFile(t, srv, "images", "vms/a.qcow2", n)
	harness.WaitFor(t, "the replaced object to show its new size", 5*time.Second, func() bool {
		st, err := os.Stat(filepath.Join(m.Dir, "a.raw"))
		return err == nil && st.Size() == 4<<20
	})
	harness.SameFile(t, filepath.Join(m.Dir, "a.raw"), filepath.Join(expect, "new.raw"))

	log := m.LogText(t)
	if strings.Contains(log, srv.Secret) {
		t.Errorf("the daemon's log shows the secret key")
	}
	if strings.Contains(log, "level=ERROR") {
		t.Errorf("the daemon logged errors:\n%s", log)
	}
}

// checkRemoteDf checks what statfs and df say of a remote mount: size and
// used space the stored bytes (rounded up to a block), none free, files
// the object count.
func checkRemoteDf(t *testing.T, dir string, stored int64, objects uint64) {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	size := int64(st.Blocks) * st.Frsize
	if size < stored || size >= stored+st.Frsize || st.Bfree != 0 || st.Bavail != 0 || st.Files != objects {
		t.Errorf("statfs of %s: %d blocks of %d (%d bytes), %d free, %d available, %d files; want %d bytes (rounded up to a block), none free, %d files",
			dir, st.Blocks, st.Frsize, size, st.Bfree, st.Bavail, st.Files, stored, objects)
	}
	out, err := exec.Command("df", "-B1", "--output=size,used,avail", dir).Output()
	if err != nil {
		t.Fatalf("df %s: %v", dir, err)
	}
	want := fmt.Sprintf("%d %d 0", size, size)
	lines := strings.Split(string(out), "\n") // a header, then the numbers
	if got := strings.Join(strings.Fields(lines[min(1, len(lines)-1)]), " "); got != want {
		t.Errorf("df -B1 %s says %q (size, used, available), want %q", dir, got, want)
	}
}

// TestRemoteS3NoImages: a prefix whose objects are none of them qcow2
// images still mounts, empty, and the mount says so in one line with the
// number of objects listed; a prefix with images says nothing of it.
func TestRemoteS3NoImages(t *testing.T) {
	srv := startS3(t, "misc")
	work := t.TempDir()
	img := filepath.Join(work, "vm.qcow2")
	qemu.Create(t, "qcow2", img, "4M")
	notes := filepath.Join(work, "notes.txt")
	os.WriteFile(notes, []byte("not an image\n"), 0o644)
	for key, path := range map[string]string{"docs/a.txt": notes, "docs/sub/b.txt": notes, "docs/c.raw": notes, "vms/vm.qcow2": img, "vms/x.txt": notes} {
		putFile(t, srv, "misc", key, path)
	}
	env := s3Env(t, srv.Access, srv.Secret)
	m := mountRemote(t, harness.Daemon{Env: env}, "s3://misc/docs/", "--s3-endpoint", srv.Endpoint)
	out := strings.TrimSpace(m.Said)
	if strings.Count(out, "\n") != 0 || !strings.Contains(out, "no qcow2 images among the 3 objects listed") {
		t.Errorf("mount of a prefix without images says %q; want one line with the 3 objects listed", out)
	}
	// (Folders of the keys are shown, empty.)
	if names := harness.Names(t, m.Dir); !reflect.DeepEqual(names, []string{"sub"}) {
		t.Errorf("the mount of a prefix without images lists %q, want the folder sub only", names)
	}
	m = mountRemote(t, harness.Daemon{Env: env}, "s3://misc/vms/", "--s3-endpoint", srv.Endpoint)
	if strings.Contains(m.Said, "no qcow2") {
		t.Errorf("mount of a prefix with an image says %q", m.Said)
	}
}
