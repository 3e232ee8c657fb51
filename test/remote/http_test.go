package remote

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"

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
	harness.RequireFUSE(t)
	root := qemu.TempDir(t)
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
			rf, err := os.Open(got)
			if err != nil {
				t.Fatal(err)
			}
			defer rf.Close()
			st, _ := rf.Stat()
			if r, q := harness.SeekRuns(t, rf, st.Size()), qemu.DataRuns(t, url); !reflect.DeepEqual(r, q) {
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
	base := filepath.Join(dir, "base.qcow2")
	qemu.Create(t, "qcow2", base, "64M")
	qemu.IO(t, base, "write -P 0x11 0 1M", "write -P 0x22 10M 3M", "write -P 0x23 40M 64k")
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
	harness.RequireFUSE(t)
	root := qemu.TempDir(t)
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
	base := filepath.Join(root, "base.qcow2")
	qemu.Create(t, "qcow2", base, "64M")
	qemu.IO(t, base, "write -P 0x11 0 1M", "write -P 0x22 10M 3M")
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
	harness.RequireFUSE(t)
	root := qemu.TempDir(t)
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
	harness.RequireFUSE(t)
	root := qemu.TempDir(t)
	img := filepath.Join(root, "sparse.qcow2")
	qemu.Create(t, "qcow2", img, "1G")
	qemu.IO(t, img, "write -P 0x41 0 1M", "write -P 0x42 300M 2M", "write -P 0x43 700M 512k", "write -P 0x44 1023M 64k")
	var st syscall.Stat_t
	if err := syscall.Stat(img, &st); err != nil {
		t.Fatal(err)
	}
	allocated := st.Blocks * 512
	ng := servers.StartNginx(t, root, false)
	m := mountRemote(t, harness.Daemon{}, ng.URL+"/sparse.qcow2")
	out := filepath.Join(t.TempDir(), "out.raw")
	if b, err := exec.Command("cp", "--sparse=always", filepath.Join(m.Dir, "sparse.raw"), out).CombinedOutput(); err != nil {
		t.Fatalf("cp: %v %s", err, b)
	}
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
	if err := syscall.Stat(out, &st); err != nil {
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
	harness.RequireFUSE(t)
	root := qemu.TempDir(t)
	img := filepath.Join(root, "vm.qcow2")
	qemu.Create(t, "qcow2", img, "8M")
	qemu.IO(t, img, "write -P 0x42 1M 1M")
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
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
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
