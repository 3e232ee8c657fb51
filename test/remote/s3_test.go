package remote

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

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
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
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
