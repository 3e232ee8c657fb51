package qcow2_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestCreateMatchesQemu: an image made by Create says in qemu-img info
// and qemu-img check what one made by qemu-img create with the same
// options says; and it writes and reads back through qemu-io.
func TestCreateMatchesQemu(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	dir := qemu.TempDir(t)
	base := filepath.Join(dir, "base.qcow2")
	qemu.Create(t, "qcow2", base, "100M")
	raw := filepath.Join(dir, "base.raw")
	qemu.Create(t, "raw", raw, "10M")
	for i, tc := range []struct {
		opts qcow2.CreateOptions
		args []string
		// layout: qemu's differs in the order of refcount blocks
		// beyond the first (its allocator's), so only info and check
		// are compared, not bytes.
		layout bool
	}{
		{qcow2.CreateOptions{Size: 100 << 20}, nil, false},
		{qcow2.CreateOptions{Size: 100 << 20, Backing: base, BackingFormat: "qcow2"}, []string{"-b", base, "-F", "qcow2"}, false},
		{qcow2.CreateOptions{Size: 10 << 20, Backing: "base.raw", BackingFormat: "raw"}, []string{"-b", "base.raw", "-F", "raw"}, false},
		{qcow2.CreateOptions{Size: 1 << 40, ClusterSize: 4096}, []string{"-o", "cluster_size=4096"}, false},
		{qcow2.CreateOptions{Size: 4 << 30, ClusterSize: 512}, []string{"-o", "cluster_size=512"}, true},
		{qcow2.CreateOptions{Size: 8 << 30, ClusterSize: 2 << 20}, []string{"-o", "cluster_size=2097152"}, false},
		{qcow2.CreateOptions{Size: 100 << 20, ExtendedL2: true, Backing: base, BackingFormat: "qcow2"}, []string{"-o", "extended_l2=on", "-b", base, "-F", "qcow2"}, false},
		{qcow2.CreateOptions{Size: 3 << 40, ClusterSize: 16384, ExtendedL2: true}, []string{"-o", "extended_l2=on,cluster_size=16384"}, false},
		{qcow2.CreateOptions{Size: 64 << 20, ClusterSize: 512, Backing: base, BackingFormat: "qcow2"}, []string{"-o", "cluster_size=512", "-b", base, "-F", "qcow2"}, false},
		{qcow2.CreateOptions{Size: 64 << 20, ClusterSize: 4096, Backing: base, BackingFormat: "qcow2"}, []string{"-o", "cluster_size=4096", "-b", base, "-F", "qcow2"}, false},
		{qcow2.CreateOptions{Size: 64 << 20, ClusterSize: 8192, Backing: base, BackingFormat: "qcow2"}, []string{"-o", "cluster_size=8192", "-b", base, "-F", "qcow2"}, false},
	} {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			ours := filepath.Join(dir, fmt.Sprintf("ours%d.qcow2", i))
			theirs := filepath.Join(dir, fmt.Sprintf("theirs%d.qcow2", i))
			if err := qcow2.Create(ours, tc.opts); err != nil {
				t.Fatal(err)
			}
			qemu.Create(t, "qcow2", theirs, fmt.Sprint(tc.opts.Size), tc.args...)
			a, b := qemu.Info(t, ours), qemu.Info(t, theirs)
			for _, m := range []map[string]any{a, b} {
				delete(m, "filename")
				delete(m, "actual-size")
			}
			if !reflect.DeepEqual(a, b) {
				t.Errorf("qemu-img info differs:\nours   %v\nqemu's %v", a, b)
			}
			// Byte for byte, too.
			if x, y := readAll(t, ours), readAll(t, theirs); !tc.layout && !bytes.Equal(x, y) {
				i := 0
				for i < min(len(x), len(y)) && x[i] == y[i] {
					i++
				}
				t.Errorf("the files differ from byte %d (sizes %d and %d)", i, len(x), len(y))
			}
			ca, cb := checkJSON(t, ours), checkJSON(t, theirs)
			if !reflect.DeepEqual(ca, cb) {
				t.Errorf("qemu-img check differs:\nours   %v\nqemu's %v", ca, cb)
			}
			if err := qcow2.Create(ours, tc.opts); err == nil {
				t.Error("Create over an existing file succeeded")
			}
			qemu.IO(t, ours, "write -P 0x42 0 1M", "write -P 0x43 5M 4k")
			if out, err := exec.Command("qemu-img", "check", ours).CombinedOutput(); err != nil {
				t.Errorf("qemu-img check after writes: %v\n%s", err, out)
			}
		})
	}
}

func readAll(t *testing.T, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func checkJSON(t *testing.T, p string) map[string]any {
	out, _ := exec.Command("qemu-img", "check", "--output=json", p).Output()
	var m map[string]any
	if err := json.Unmarshal(out, &m); err != nil {
		t.Fatalf("qemu-img check %s: %v: %s", p, err, out)
	}
	delete(m, "filename")
	return m
}

// TestPreparePublish: a prepared image is not at its name until
// published; publishing never replaces a file that appeared meanwhile.
func TestPreparePublish(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "a.qcow2")
	p, err := qcow2.Prepare(path, qcow2.CreateOptions{Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatalf("image at its name before Publish: %v", err)
	}
	if err := os.WriteFile(path, []byte("someone else's"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := p.Publish(); !errors.Is(err, os.ErrExist) {
		t.Fatalf("Publish over an existing file: %v, want ErrExist", err)
	}
	if b, _ := os.ReadFile(path); string(b) != "someone else's" {
		t.Fatalf("the existing file was replaced")
	}
	if _, err := os.Stat(p.Temp()); !os.IsNotExist(err) {
		t.Fatalf("temporary file left behind: %v", err)
	}
	os.Remove(path)
	p, err = qcow2.Prepare(path, qcow2.CreateOptions{Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Publish(); err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Fatalf("folder holds %d files after Publish, want 1", len(ents))
	}
}

// TestCreateExtensionKept: an extension of the caller's own, made by
// Create, is read back by Open, and qemu keeps it, unchanged, through
// every command that rewrites the header (amend, rebase -u, resize,
// snapshot, commit into and out of the image, writes), with the image
// clean by qemu-img check throughout. (Overlays over remote images
// record the version of their base in one: fs/overlaybase.go.)
func TestCreateExtensionKept(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	dir := qemu.TempDir(t)
	base := filepath.Join(dir, "base.qcow2")
	qemu.Create(t, "qcow2", base, "64M")
	qemu.IO(t, base, "write -P 0x11 0 4M")
	const typ = 0x71636673
	data := []byte("a fact of our own\t\"etag\"\n")
	for _, cs := range []int64{512, 4096, 65536} {
		t.Run(fmt.Sprint(cs), func(t *testing.T) {
			ov := filepath.Join(dir, fmt.Sprintf("ov%d.qcow2", cs))
			opts := qcow2.CreateOptions{Size: 64 << 20, ClusterSize: cs, Backing: base, BackingFormat: "qcow2",
				Extensions: []qcow2.Extension{{Type: typ, Data: data}}}
			if err := qcow2.Create(ov, opts); err != nil {
				t.Fatal(err)
			}
			kept := func(after string) {
				t.Helper()
				qemu.CheckClean(t, ov)
				img, err := qcow2.Open(ov, qcow2.Options{AllowedDirs: []string{dir}})
				if err != nil {
					t.Fatalf("after %s: %v", after, err)
				}
				defer img.Close()
				got, ok := img.Header().Extension(typ)
				if !ok || !bytes.Equal(got, data) {
					t.Errorf("after %s: extension %#x is %q (%v), want %q; all: %+v", after, typ, got, ok, data, img.Header().Extensions)
				}
			}
			kept("create")
			top := filepath.Join(dir, fmt.Sprintf("top%d.qcow2", cs))
			for _, step := range []struct {
				what string
				run  func()
			}{
				{"qemu-io write", func() { qemu.IO(t, ov, "write -P 0x22 1M 64k") }},
				{"qemu-img amend", func() { qemu.Img(t, "amend", "-o", "lazy_refcounts=on", ov) }},
				{"qemu-img rebase -u", func() { qemu.Img(t, "rebase", "-u", "-b", base, "-F", "qcow2", ov) }},
				{"qemu-img resize", func() { qemu.Img(t, "resize", "-q", ov, "+1M") }},
				{"qemu-img snapshot -c", func() { qemu.Img(t, "snapshot", "-c", "s1", ov) }},
				{"qemu-img commit into it", func() {
					qemu.Create(t, "qcow2", top, "65M", "-b", ov, "-F", "qcow2")
					qemu.IO(t, top, "write -P 0x33 2M 64k")
					qemu.Img(t, "commit", "-q", top)
				}},
				{"qemu-img commit of it", func() { qemu.Img(t, "commit", "-q", "-d", ov) }},
				{"qemu-img amend to compat=0.10 and back", func() {
					qemu.Img(t, "snapshot", "-d", "s1", ov)
					qemu.Img(t, "amend", "-o", "compat=0.10", ov)
					qemu.Img(t, "amend", "-o", "compat=1.1", ov)
				}},
			} {
				step.run()
				kept(step.what)
			}
		})
	}
}
