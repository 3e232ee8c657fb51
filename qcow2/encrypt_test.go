package qcow2_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/qcowfs/qcowfs/luks"
	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// Encrypted images made by qemu, read and written through the library,
// with qemu (given the same secrets) as the oracle.

// encImage is an encrypted image of the matrix.
type encImage struct {
	name    string
	path    string
	secrets map[string]string // file name -> passphrase, for the chain
}

// passphrases gives the library each file's passphrase.
func (e encImage) passphrases() func(string) []byte {
	return func(file string) []byte {
		if p, ok := e.secrets[filepath.Base(file)]; ok {
			return []byte(p)
		}
		return nil
	}
}

// encryptedMatrix makes the matrix in dir: cipher specifications at 64
// KiB clusters, 512 B and 2 MiB clusters, extended L2, a chain of two
// encrypted images with different passphrases, an encrypted image over a
// plain backing file, and qemu's legacy AES. Each holds data written by
// qemu.
func encryptedMatrix(t *testing.T, dir string) []encImage {
	var out []encImage
	secretFile := func(name, pass string) string {
		p := filepath.Join(dir, name+".key")
		os.WriteFile(p, []byte(pass), 0o600)
		return p
	}
	create := func(name, pass, size string, opts ...string) string {
		p := filepath.Join(dir, name+".qcow2")
		key := secretFile(name, pass)
		args := append([]string{"create", "-q", "-f", "qcow2", "--object", "secret,id=s0,file=" + key}, opts...)
		args = append(args, p, size)
		qemu.Img(t, args...)
		return p
	}
	io := func(p, pass, extra string, cmds ...string) {
		key := secretFile(filepath.Base(p)+"-io", pass)
		args := []string{"--object", "secret,id=s0,file=" + key, "--image-opts", "driver=qcow2,file.filename=" + p + ",encrypt.key-secret=s0" + extra}
		for _, c := range cmds {
			args = append(args, "-c", c)
		}
		qemu.Run(t, "qemu-io", args...)
	}
	writes := []string{"write -P 0x11 0 100k", "write -P 0x22 1M 64k", "write -P 0x33 3000k 7k", "write -z 200k 64k"}
	luks := func(name, cipher string, cs int, extra ...string) {
		o := "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10," + cipher + fmt.Sprintf(",cluster_size=%d", cs)
		for _, e := range extra {
			o += "," + e
		}
		p := create(name, "pass-"+name, "4M", "-o", o)
		io(p, "pass-"+name, "", writes...)
		out = append(out, encImage{name: name, path: p, secrets: map[string]string{filepath.Base(p): "pass-" + name}})
	}
	luks("xts-aes256", "encrypt.cipher-alg=aes-256,encrypt.cipher-mode=xts", 65536)
	luks("xts-aes128-c512", "encrypt.cipher-alg=aes-128,encrypt.cipher-mode=xts", 512)
	luks("cbc-essiv-c2m", "encrypt.cipher-alg=aes-256,encrypt.cipher-mode=cbc,encrypt.ivgen-alg=essiv,encrypt.ivgen-hash-alg=sha256", 2<<20)
	luks("cbc-plain-sha1", "encrypt.cipher-alg=aes-128,encrypt.cipher-mode=cbc,encrypt.ivgen-alg=plain,encrypt.hash-alg=sha1", 65536)
	luks("xts-aes192-sha512", "encrypt.cipher-alg=aes-192,encrypt.cipher-mode=xts,encrypt.hash-alg=sha512", 65536)
	luks("twofish-extl2", "encrypt.cipher-alg=twofish-256,encrypt.cipher-mode=xts", 32768, "extended_l2=on")

	// A chain: an encrypted base, an encrypted overlay with another
	// passphrase; and an encrypted overlay over a plain file.
	base := create("chain-base", "base secret", "4M", "-o", "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10")
	io(base, "base secret", "", "write -P 0x44 0 4M")
	top := create("chain-top", "top secret", "4M", "-b", "chain-base.qcow2", "-F", "qcow2", "-o", "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10,cluster_size=4096")
	keyb := secretFile("chain-base-io2", "base secret")
	keyt := secretFile("chain-top-io2", "top secret")
	qemu.Run(t, "qemu-io", "--object", "secret,id=s0,file="+keyt, "--object", "secret,id=s1,file="+keyb, "--image-opts",
		"driver=qcow2,file.filename="+top+",encrypt.key-secret=s0,backing.encrypt.key-secret=s1", "-c", "write -P 0x55 8k 20k", "-c", "write -z 1M 4k")
	out = append(out, encImage{name: "chain", path: top, secrets: map[string]string{"chain-top.qcow2": "top secret", "chain-base.qcow2": "base secret"}})

	plain := filepath.Join(dir, "plain-base.qcow2")
	qemu.Create(t, "qcow2", plain, "4M")
	qemu.IO(t, plain, "write -P 0x66 0 4M")
	over := create("over-plain", "over secret", "4M", "-b", "plain-base.qcow2", "-F", "qcow2", "-o", "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10,cluster_size=16384")
	io(over, "over secret", "", "write -P 0x77 5000 3000")
	out = append(out, encImage{name: "over-plain", path: over, secrets: map[string]string{"over-plain.qcow2": "over secret"}})

	aes := create("legacy-aes", "old", "4M", "-o", "encrypt.format=aes,encrypt.key-secret=s0")
	io(aes, "old", "", writes...)
	out = append(out, encImage{name: "legacy-aes", path: aes, secrets: map[string]string{"legacy-aes.qcow2": "old"}})
	return out
}

// qemuRaw converts the image to raw with qemu, given its secrets.
func (e encImage) qemuRaw(t *testing.T, dir, raw string) {
	t.Helper()
	qemu.Img(t, append(e.qemuOpts(t, dir, "convert"), "-O", "raw", raw)...)
}

// qemuCheck runs qemu-img check with the secrets and returns its output
// and error.
func (e encImage) qemuCheck(t *testing.T, dir string) ([]byte, error) {
	return exec.Command("qemu-img", e.qemuOpts(t, dir, "check")...).CombinedOutput()
}

// qemuOpts are the arguments of qemu-img cmd for the image: secret
// objects and --image-opts naming them.
func (e encImage) qemuOpts(t *testing.T, dir, cmd string) []string {
	args := []string{cmd}
	// secret ids in the order qemuArgs makes them; the image's own is
	// the one named after it.
	keys := map[string]string{}
	i := 0
	for name, p := range e.secrets {
		key := filepath.Join(dir, fmt.Sprintf("%s.conv%d", e.name, i))
		os.WriteFile(key, []byte(p), 0o600)
		id := fmt.Sprintf("k%d", i)
		keys[name] = id
		args = append(args, "--object", fmt.Sprintf("secret,id=%s,file=%s", id, key))
		i++
	}
	opts := "driver=qcow2,file.filename=" + e.path + ",encrypt.key-secret=" + keys[filepath.Base(e.path)]
	for name, id := range keys {
		if name != filepath.Base(e.path) { // the backing file's (chains of two here)
			opts += ",backing.encrypt.key-secret=" + id
		}
	}
	return append(args, "--image-opts", opts)
}

func openEncrypted(t *testing.T, e encImage, writable bool) *qcow2.Image {
	t.Helper()
	opts := qcow2.Options{Passphrase: e.passphrases(), Writable: writable}
	var img *qcow2.Image
	var err error
	if writable {
		f, ferr := qcow2.OpenWritableFile(e.path)
		if ferr != nil {
			t.Fatal(ferr)
		}
		img, err = qcow2.NewImage(f, opts)
	} else {
		img, err = qcow2.Open(e.path, opts)
	}
	if err != nil {
		t.Fatalf("%s: %v", e.name, err)
	}
	return img
}

// TestEncryptedReadsAsQemu: every image of the matrix reads, byte for
// byte, as qemu-img convert with the secrets makes it; a wrong or missing
// passphrase is a KeyError.
func TestEncryptedReadsAsQemu(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	dir := t.TempDir()
	for _, e := range encryptedMatrix(t, dir) {
		t.Run(e.name, func(t *testing.T) {
			raw := filepath.Join(dir, e.name+".raw")
			e.qemuRaw(t, dir, raw)
			want, _ := os.ReadFile(raw)
			img := openEncrypted(t, e, false)
			defer img.Close()
			got := make([]byte, len(want))
			if _, err := img.ReadAt(got, 0); err != nil {
				t.Fatal(err)
			}
			if i := firstDiff(got, want); i >= 0 {
				t.Fatalf("byte %d: %#x, qemu %#x", i, got[i], want[i])
			}
			// Unaligned reads, across sectors and clusters.
			for _, r := range [][2]int64{{1, 1}, {511, 2}, {1000, 5000}, {65535, 3}, {3000 * 1024, 7 * 1024}} {
				b := make([]byte, r[1])
				if _, err := img.ReadAt(b, r[0]); err != nil || !bytes.Equal(b, want[r[0]:r[0]+r[1]]) {
					t.Fatalf("ReadAt(%d, %d): %v, equal %v", r[0], r[1], err, bytes.Equal(b, want[r[0]:r[0]+r[1]]))
				}
			}
			for file := range e.secrets {
				if e.name == "legacy-aes" {
					break // no key check in that format: a wrong key reads noise, in qemu too
				}
				bad := qcow2.Options{Passphrase: func(f string) []byte {
					if filepath.Base(f) == file {
						return []byte("not it")
					}
					return e.passphrases()(f)
				}}
				_, err := qcow2.Open(e.path, bad)
				var ke *qcow2.KeyError
				if !errors.As(err, &ke) || ke.Missing || filepath.Base(ke.File) != file {
					t.Errorf("a wrong passphrase for %s: %v", file, err)
				}
			}
			_, err := qcow2.Open(e.path, qcow2.Options{})
			var ke *qcow2.KeyError
			if !errors.As(err, &ke) || !ke.Missing {
				t.Errorf("no passphrase: %v", err)
			}
		})
	}
}

// TestEncryptedWrites: writes, zero-writes, discards and a grow through
// the library on every writable image of the matrix, against a raw model;
// then qemu-img check with the secrets is clean and qemu-img convert
// equals the model, and the base of the chain is unchanged.
func TestEncryptedWrites(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	t.Parallel() // (beside the package's other long tests; it has its own folder)
	dir := t.TempDir()
	for _, e := range encryptedMatrix(t, dir) {
		if e.name == "legacy-aes" {
			img := openEncrypted(t, e, true)
			if img.Writable() || !strings.Contains(img.ReadOnlyReason(), "legacy AES") {
				t.Errorf("legacy AES opened writable: %q", img.ReadOnlyReason())
			}
			img.Close()
			continue
		}
		t.Run(e.name, func(t *testing.T) {
			before := filepath.Join(dir, e.name+".before")
			e.qemuRaw(t, dir, before)
			model, _ := os.ReadFile(before)
			var baseSum [32]byte
			if e.name == "chain" {
				baseSum = sha(t, filepath.Join(dir, "chain-base.qcow2"))
			}
			img := openEncrypted(t, e, true)
			if !img.Writable() {
				t.Fatalf("read-only: %s", img.ReadOnlyReason())
			}
			cs := int64(img.Header().ClusterSize())
			for _, op := range qemu.Ops(7, 40, int64(len(model)), cs) {
				apply(t, img, op)
				model = op.Apply(model)
			}
			got := make([]byte, len(model))
			if _, err := img.ReadAt(got, 0); err != nil {
				t.Fatal(err)
			}
			if i := firstDiff(got, model); i >= 0 {
				t.Fatalf("before close, byte %d: %#x, model %#x", i, got[i], model[i])
			}
			if err := img.Close(); err != nil {
				t.Fatal(err)
			}
			after := filepath.Join(dir, e.name+".after")
			e.qemuRaw(t, dir, after)
			b, _ := os.ReadFile(after)
			if i := firstDiff(b, model); i >= 0 || len(b) != len(model) {
				t.Fatalf("qemu-img convert differs from the model at %d (%d bytes, model %d)", i, len(b), len(model))
			}
			if out, err := e.qemuCheck(t, dir); err != nil {
				t.Fatalf("qemu-img check: %v\n%s", err, out)
			}
			if e.name == "chain" && sha(t, filepath.Join(dir, "chain-base.qcow2")) != baseSum {
				t.Error("the base changed")
			}
		})
	}
}

// TestCreateEncryptedOverlay: an overlay made by Create over an encrypted
// base, encrypted with its own passphrase and the base's cipher and costs,
// is what qemu opens with the two secrets: check clean, the same cipher in
// info, the base's content through it; written through the library, it
// reads in qemu as the model, and the base is unchanged.
func TestCreateEncryptedOverlay(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	dir := t.TempDir()
	var base encImage
	for _, e := range encryptedMatrix(t, dir) {
		if e.name == "cbc-essiv-c2m" {
			base = e
		}
	}
	img := openEncrypted(t, base, false)
	enc, ok := img.Encryption([]byte("overlay pass"))
	size := img.Size()
	img.Close()
	if !ok {
		t.Fatal("the base does not say it is encrypted")
	}
	over := filepath.Join(dir, "over.qcow2")
	if err := qcow2.Create(over, qcow2.CreateOptions{Size: size, Backing: filepath.Base(base.path), BackingFormat: "qcow2", Encrypt: enc}); err != nil {
		t.Fatal(err)
	}
	oe := encImage{name: "over", path: over, secrets: map[string]string{"over.qcow2": "overlay pass", filepath.Base(base.path): base.secrets[filepath.Base(base.path)]}}
	if out, err := oe.qemuCheck(t, dir); err != nil {
		t.Fatalf("qemu-img check: %v\n%s", err, out)
	}
	info := string(qemu.Img(t, "info", over))
	for _, want := range []string{"format: luks", "cipher alg: aes-256", "cipher mode: cbc", "ivgen alg: essiv", "ivgen hash alg: sha256"} {
		if !strings.Contains(info, want) {
			t.Errorf("qemu-img info lacks %q:\n%s", want, info)
		}
	}
	want := filepath.Join(dir, "base.raw")
	base.qemuRaw(t, dir, want)
	got := filepath.Join(dir, "over.raw")
	oe.qemuRaw(t, dir, got)
	if a, b := sha(t, want), sha(t, got); a != b {
		t.Fatal("the overlay does not read as its base in qemu")
	}
	baseSum := sha(t, base.path)
	model, _ := os.ReadFile(want)
	w := openEncrypted(t, oe, true)
	for _, op := range qemu.Ops(3, 20, size, 65536) {
		apply(t, w, op)
		model = op.Apply(model)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	oe.qemuRaw(t, dir, got)
	if b, _ := os.ReadFile(got); !bytes.Equal(b, model) {
		t.Fatal("the written overlay differs from the model in qemu")
	}
	if out, err := oe.qemuCheck(t, dir); err != nil {
		t.Fatalf("qemu-img check: %v\n%s", err, out)
	}
	if sha(t, base.path) != baseSum {
		t.Error("the base changed")
	}
}

// TestEncryptedInfoAndMap: an image opened with its passphrase describes
// its encryption as qemu-img info does (the encrypt block, "encrypted"),
// and maps as qemu-img map with the secrets does: no host offset for an
// encrypted layer's data, which is ciphertext there.
func TestEncryptedInfoAndMap(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	dir := t.TempDir()
	for _, e := range encryptedMatrix(t, dir) {
		t.Run(e.name, func(t *testing.T) {
			img := openEncrypted(t, e, false)
			defer img.Close()
			type encInfo struct {
				Encrypted      bool `json:"encrypted"`
				FormatSpecific struct {
					Data struct {
						Encrypt map[string]any `json:"encrypt"`
					} `json:"data"`
				} `json:"format-specific"`
			}
			var us, them encInfo
			b, _ := json.Marshal(img.Info())
			json.Unmarshal(b, &us)
			json.Unmarshal(qemu.Img(t, "info", "--output=json", e.path), &them)
			if !them.Encrypted || !reflect.DeepEqual(us, them) {
				t.Errorf("Info: %+v\nqemu-img info: %+v", us, them)
			}
			var want []qemu.MapEntry
			if err := json.Unmarshal(qemu.Img(t, append(e.qemuOpts(t, dir, "map"), "--output=json")...), &want); err != nil {
				t.Fatal(err)
			}
			var got []qemu.MapEntry
			err := img.Map(context.Background(), func(m qcow2.MapEntry) error {
				got = append(got, qemu.MapEntry{Start: m.Start, Length: m.Length, Depth: m.Depth, Present: m.Present, Zero: m.Zero, Data: m.Data, Offset: m.Offset})
				return nil
			})
			if err != nil || !reflect.DeepEqual(got, want) {
				gj, _ := json.Marshal(got)
				wj, _ := json.Marshal(want)
				t.Errorf("map: %v\n%s\nqemu-img map:\n%s", err, gj, wj)
			}
		})
	}
}

// TestEncryptedUnsupportedBeforeKey: a cipher the library lacks (serpent)
// is the reason an image does not open, with or without a passphrase,
// rather than the missing key.
func TestEncryptedUnsupportedBeforeKey(t *testing.T) {
	qemu.Require(t, "qemu-img")
	dir := t.TempDir()
	key := filepath.Join(dir, "key")
	os.WriteFile(key, []byte("pass"), 0o600)
	p := filepath.Join(dir, "serpent.qcow2")
	qemu.Img(t, "create", "-q", "-f", "qcow2", "--object", "secret,id=s0,file="+key,
		"-o", "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10,encrypt.cipher-alg=serpent-256", p, "1M")
	for _, pass := range []func(string) []byte{nil, func(string) []byte { return []byte("pass") }} {
		_, err := qcow2.Open(p, qcow2.Options{Passphrase: pass})
		if !errors.Is(err, qcow2.ErrUnsupported) || !strings.Contains(err.Error(), `"serpent"`) {
			t.Errorf("with passphrase %v: %v, want serpent named as unsupported", pass != nil, err)
		}
	}
}

// TestEncryptedTailAfterGrow: a write into the last cluster of an
// encrypted disk whose size is not a multiple of the cluster writes the
// cluster's bytes past the end as encrypted zeros, as qemu does; so once
// qemu grows the disk (qemu-img resize, which writes nothing there) they
// read as zeros in qemu, and so they do after the library's own grow.
func TestEncryptedTailAfterGrow(t *testing.T) {
	qemu.Require(t, "qemu-img")
	dir := t.TempDir()
	key := filepath.Join(dir, "key")
	os.WriteFile(key, []byte("pass"), 0o600)
	const size = 24*65536 + 3*512
	for _, ext := range []string{"off", "on"} {
		t.Run("extended_l2="+ext, func(t *testing.T) {
			p := filepath.Join(dir, "tail-"+ext+".qcow2")
			qemu.Img(t, "create", "-q", "-f", "qcow2", "--object", "secret,id=s0,file="+key,
				"-o", "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10,extended_l2="+ext, p, fmt.Sprint(size))
			e := encImage{name: "tail-" + ext, path: p, secrets: map[string]string{filepath.Base(p): "pass"}}
			img := openEncrypted(t, e, true)
			data := bytes.Repeat([]byte{0x5a}, 1000)
			if _, err := img.WriteAt(data, size-1000); err != nil {
				t.Fatal(err)
			}
			if err := img.Close(); err != nil {
				t.Fatal(err)
			}
			qemu.Img(t, append(e.qemuOpts(t, dir, "resize"), "2M")...)
			raw := filepath.Join(dir, e.name+".raw")
			e.qemuRaw(t, dir, raw)
			b, _ := os.ReadFile(raw)
			if !bytes.Equal(b[size-1000:size], data) {
				t.Fatal("the write does not read back in qemu")
			}
			if i := bytes.IndexFunc(b[size:], func(r rune) bool { return r != 0 }); i >= 0 {
				t.Errorf("after qemu-img resize, qemu reads %#x at %d, past the old end %d", b[size+i], size+i, size)
			}
			if out, err := e.qemuCheck(t, dir); err != nil {
				t.Fatalf("qemu-img check: %v\n%s", err, out)
			}
			img = openEncrypted(t, e, true)
			defer img.Close()
			if err := img.Resize(3 << 20); err != nil {
				t.Fatal(err)
			}
			got := make([]byte, 3<<20-size)
			if _, err := img.ReadAt(got, size); err != nil {
				t.Fatal(err)
			}
			if i := bytes.IndexFunc(got, func(r rune) bool { return r != 0 }); i >= 0 {
				t.Errorf("after Resize, %#x at %d", got[i], size+i)
			}
		})
	}
}

// TestKeyCache: an image opened again with a KeyCache is not unlocked
// again (no PBKDF2: the unlocks are counted) and reads what was written; a
// second image under the same passphrase is unlocked for itself; a wrong
// passphrase is still refused (and not remembered); after Close the cache
// remembers nothing and the image is unlocked afresh.
func TestKeyCache(t *testing.T) {
	dir := t.TempDir()
	data := bytes.Repeat([]byte("cached "), 1000)
	pass := func(string) []byte { return []byte("pass") }
	var paths []string
	for _, name := range []string{"a.qcow2", "b.qcow2"} {
		p := filepath.Join(dir, name)
		enc := &qcow2.Encryption{Passphrase: []byte("pass"), Params: luks.Params{Iterations: 1000, MKDigestIter: 1000}}
		if err := qcow2.Create(p, qcow2.CreateOptions{Size: 1 << 20, Encrypt: enc}); err != nil {
			t.Fatal(err)
		}
		w, err := qcow2.OpenWritableFile(p)
		if err != nil {
			t.Fatal(err)
		}
		img, err := qcow2.NewImage(w, qcow2.Options{Writable: true, Passphrase: pass})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := img.WriteAt(data, 4096); err != nil {
			t.Fatal(err)
		}
		if err := img.Close(); err != nil {
			t.Fatal(err)
		}
		paths = append(paths, p)
	}
	kc := qcow2.NewKeyCache()
	unlocks := qcow2.CountUnlocks(t)
	open := func(p string, pass func(string) []byte) error {
		img, err := qcow2.Open(p, qcow2.Options{Passphrase: pass, KeyCache: kc})
		if err != nil {
			return err
		}
		defer img.Close()
		got := make([]byte, len(data))
		if _, err := img.ReadAt(got, 4096); err != nil || !bytes.Equal(got, data) {
			t.Errorf("%s: read %v, equal %v", filepath.Base(p), err, bytes.Equal(got, data))
		}
		return nil
	}
	var ke *qcow2.KeyError
	for _, step := range []struct {
		what    string
		path    string
		pass    func(string) []byte
		wrong   bool
		unlocks int64 // the count after the step
	}{
		{"first open", paths[0], pass, false, 1},
		{"opened again", paths[0], pass, false, 1},
		{"and again", paths[0], pass, false, 1},
		{"another image, same passphrase", paths[1], pass, false, 2},
		{"wrong passphrase", paths[0], func(string) []byte { return []byte("wrong") }, true, 3},
		{"wrong passphrase again", paths[0], func(string) []byte { return []byte("wrong") }, true, 4},
		{"the right one after the wrong", paths[0], pass, false, 4},
	} {
		err := open(step.path, step.pass)
		switch {
		case step.wrong && !errors.As(err, &ke):
			t.Errorf("%s: %v, want a KeyError", step.what, err)
		case !step.wrong && err != nil:
			t.Errorf("%s: %v", step.what, err)
		}
		if n := unlocks.Load(); n != step.unlocks {
			t.Errorf("%s: %d unlocks so far, want %d", step.what, n, step.unlocks)
		}
	}
	kc.Close()
	if err := open(paths[0], pass); err != nil {
		t.Errorf("after Close: %v", err)
	}
	if err := open(paths[0], pass); err != nil {
		t.Errorf("after Close, again: %v", err)
	}
	// A closed cache remembers nothing: both opens unlocked.
	if n := unlocks.Load(); n != 6 {
		t.Errorf("after Close: %d unlocks, want 6", n)
	}
}
