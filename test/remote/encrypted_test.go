package remote

import (
	"bytes"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
	"github.com/qcowfs/qcowfs/test/servers"
)

// TestRemoteEncryptedHTTP serves encrypted images with nginx (a cipher
// of each family, 512 B and 2 MiB clusters, extended L2, a chain with two
// passphrases whose base the server holds too, over a plain base, legacy
// AES) and mounts each by its URL with --key-dir, whose files are named
// by their path below the URL's folder: the raw file equals qemu-img
// convert with the secrets (cmp), lseek finds the data qemu-img map of
// the URL with the secrets finds (qemu's curl driver). The server only
// ever holds ciphertext: the patterns written are not in its files. A
// wrong key fails the mount, naming it.
func TestRemoteEncryptedHTTP(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "qemu-img", "qemu-io", "cmp")
	root := qemu.TempDir(t)
	src := filepath.Join(root, "m")
	os.Mkdir(src, 0o755)
	images := qemu.EncryptedMatrix(t, src, []qemu.LUKSSpec{
		{Cipher: "twofish-256", Mode: "cbc", Ivgen: "essiv", IvgenHash: "sha256", Hash: "sha1"},
		{Cipher: "cast5-128", Mode: "ctr", Ivgen: "plain64", Hash: "sha512"},
	})
	kdir := qemu.KeyDir(t, src, images)
	ng := servers.StartNginx(t, root, false)
	expect := t.TempDir()
	for _, e := range images {
		t.Run(e.Name, func(t *testing.T) {
			url := ng.URL + "/m/" + filepath.Base(e.Path)
			m := mountRemote(t, harness.Daemon{Racy: true}, url, "--key-dir", kdir)
			got := filepath.Join(m.Dir, e.Name+".raw")
			runs := harness.FileRuns(t, got)
			remote := e
			remote.Path = url
			if q := remote.DataRuns(t); !reflect.DeepEqual(runs, q) {
				t.Errorf("lseek data runs through the mount %v; qemu-img map of the URL with the secrets %v", runs, q)
			}
			want := e.ToRaw(t, filepath.Join(expect, e.Name+".raw"))
			harness.WantOK(t, "cmp", harness.Exec(t, "cmp", got, want))
			served, _ := os.ReadFile(e.Path)
			if bytes.Contains(served, bytes.Repeat([]byte{0x11}, 4096)) {
				t.Error("the server holds written data in the clear")
			}
			m.NoPanics(t)
		})
	}
	bad := filepath.Join(t.TempDir(), "bad")
	os.WriteFile(bad, []byte("wrong"), 0o600)
	url := ng.URL + "/m/luks-c512.qcow2"
	_, out, err := tryMountRemote(t, harness.Daemon{}, url, "--key-file", bad)
	if err == nil || !strings.Contains(out, "encrypted: wrong passphrase (--key-file "+bad+")") {
		t.Errorf("mounting %s with a wrong key: %v, %q", url, err, out)
	}
}

// TestRemoteEncryptedS3 puts encrypted images in a bucket (one in a
// folder, a chain across folders) and mounts the prefix: each raw file
// equals qemu-img convert with the secrets; keys come from --key-dir by
// path below the prefix, and for one image from --key-file; an image
// whose key is wrong is not shown, with its line, and the others are.
func TestRemoteEncryptedS3(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "qemu-img", "qemu-io", "cmp")
	srv := startS3(t, "images")
	work := qemu.TempDir(t)
	images := qemu.EncryptedMatrix(t, work, nil)
	kdir := qemu.KeyDir(t, work, images)
	os.Remove(filepath.Join(kdir, "luks-c2m.qcow2")) // its key is the --key-file
	keyFile := filepath.Join(t.TempDir(), "key")
	os.WriteFile(keyFile, []byte("pass-luks-c2m"), 0o600)
	os.WriteFile(filepath.Join(kdir, "over-plain.qcow2"), []byte("not its passphrase"), 0o600)
	names, _ := filepath.Glob(filepath.Join(work, "*.qcow2"))
	for _, n := range names {
		putFile(t, srv, "images", "vms/"+filepath.Base(n), n)
	}
	env := s3Env(t, srv.Access, srv.Secret)
	m := mountRemote(t, harness.Daemon{Env: env, Racy: true}, "s3://images/vms/", "--s3-endpoint", srv.Endpoint, "--key-dir", kdir, "--key-file", keyFile)
	line := "not shown: s3://images/vms/over-plain.qcow2: encrypted: wrong passphrase (--key-dir file " + filepath.Join(kdir, "over-plain.qcow2") + ")"
	if strings.Count(m.Said, "not shown") != 1 || !strings.Contains(m.Said, line) {
		t.Errorf("qcowfs mount said:\n%s\nwant the one line %q", m.Said, line)
	}
	expect := t.TempDir()
	for _, e := range images {
		if e.Name == "over-plain" {
			continue
		}
		t.Run(e.Name, func(t *testing.T) {
			want := e.ToRaw(t, filepath.Join(expect, e.Name+".raw"))
			harness.WantOK(t, "cmp", harness.Exec(t, "cmp", filepath.Join(m.Dir, e.Name+".raw"), want))
		})
	}
	m.NoPanics(t)
}

// TestRemoteEncryptedOverlay: an encrypted image over http, mounted with
// --writable --overlay and --key-dir alone: the first write makes an
// overlay LUKS-encrypted over the URL, which opens with the original's
// passphrase (its key found by the overlay's path below the overlay
// folder, the original's by its path below the URL's folder); qemu opens
// the overlay with that secret for both files, reading the base over
// http itself, and finds the model; the written data is not in the
// overlay in the clear; the server got only GETs and HEADs.
func TestRemoteEncryptedOverlay(t *testing.T) {
	root := harness.SourceDir(t)
	base := filepath.Join(root, "vm.qcow2")
	qemu.CreateLUKS(t, base, "remote pass", "16M", "")
	e := qemu.EncImage{Name: "vm", Path: base, Secrets: map[string]string{"vm.qcow2": "remote pass"}, Chain: []string{"vm.qcow2"}}
	e.IO(t, "write -P 0x3c 0 3M")
	work := t.TempDir()
	model, err := os.ReadFile(e.ToRaw(t, filepath.Join(work, "before.raw")))
	if err != nil {
		t.Fatal(err)
	}
	kdir := qemu.KeyDir(t, root, []qemu.EncImage{e})
	ng := servers.StartNginx(t, root, false)
	url := ng.URL + "/vm.qcow2"
	ov := filepath.Join(t.TempDir(), "overlays")

	m := mountRemote(t, harness.Racy, url, "--writable", "--overlay", ov, "--key-dir", kdir)
	data := bytes.Repeat([]byte("remote overlay, encrypted. "), 4000)
	f := harness.OpenFile(t, filepath.Join(m.Dir, "vm.raw"), os.O_RDWR)
	if _, err := f.WriteAt(data, 2<<20+123); err != nil {
		t.Fatalf("writing through the mount: %v", err)
	}
	if err := f.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	copy(model[2<<20+123:], data)
	m.Unmount(t)
	m.NoPanics(t)

	o := e
	o.Path = filepath.Join(ov, "vm.qcow2")
	o.Chain = []string{"vm.qcow2", "vm.qcow2"} // the overlay has the original's passphrase
	if info := string(qemu.Img(t, "info", o.Path)); !strings.Contains(info, "format: luks") || !strings.Contains(info, "backing file: "+url) {
		t.Errorf("the overlay is not a LUKS image over the URL:\n%s", info)
	}
	want := filepath.Join(work, "model.raw")
	if err := os.WriteFile(want, model, 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := curlQemu(t, append(o.Args(t, "compare"), "driver=raw,file.filename="+want)...); err != nil {
		t.Errorf("qemu-img compare of the overlay (its base over http) with the model: %v\n%s", err, out)
	}
	harness.NotInClear(t, o.Path, data[:64])
	for _, a := range ng.Log(t) {
		if a.Method != "GET" && a.Method != "HEAD" {
			t.Errorf("nginx got %s %s: an overlay mount only reads", a.Method, a.URI)
		}
	}
}
