package write

import (
	"bytes"
	"errors"
	"hash/fnv"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// encState is one encrypted image written through a mount.
type encState struct {
	e     qemu.EncImage
	f     *os.File
	model []byte
	ops   []qemu.Op
	clear []byte // a piece of the first write's data, which must never land in the clear
}

// newEncStates reads each image's model (qemu-img convert with the
// secrets) and picks its operations.
func newEncStates(t *testing.T, work string, images []qemu.EncImage, salt string) []*encState {
	var all []*encState
	for _, e := range images {
		s := &encState{e: e}
		var err error
		if s.model, err = os.ReadFile(e.ToRaw(t, filepath.Join(work, e.Name+".before"))); err != nil {
			t.Fatal(err)
		}
		h := fnv.New64a()
		h.Write([]byte(salt + e.Name))
		s.ops = qemu.Ops(h.Sum64(), 40, int64(len(s.model)), e.ClusterSize)
		for _, op := range s.ops {
			if op.Kind == qemu.OpWrite && op.Len >= 64 {
				s.clear = op.Data()[:64]
				break
			}
		}
		all = append(all, s)
	}
	return all
}

// write applies every state's operations through the mount at dir,
// interleaved, and checks that the mount reads the models.
func writeEncStates(t *testing.T, dir string, all []*encState) {
	for _, s := range all {
		var err error
		if s.f, err = os.OpenFile(filepath.Join(dir, s.e.Name+".raw"), os.O_RDWR, 0); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 40 {
		for _, s := range all {
			applyThrough(t, s.f, s.ops[i])
			s.model = s.ops[i].Apply(s.model)
		}
	}
	for _, s := range all {
		got, err := os.ReadFile(filepath.Join(dir, s.e.Name+".raw"))
		if err != nil {
			t.Fatal(err)
		}
		if i := harness.FirstDiff(got, s.model); i >= 0 {
			t.Errorf("%s: the mount reads differently from the model at byte %d", s.e.Name, i)
		}
		if err := s.f.Close(); err != nil {
			t.Errorf("%s: close: %v", s.e.Name, err)
		}
	}
}

// TestEncryptedWritesThroughMount writes every writable kind of encrypted
// image through a writable mount with --key-dir (each cipher, mode and IV
// generator; 512 B and 2 MiB clusters; extended L2; the top of a chain
// with two passphrases; over a plain file): pwrite, punch, zero range,
// grow and fsync, interleaved. After unmount, qemu-img compare with the
// secrets finds each image equal to its raw model, qemu-img check with
// the secrets finds it clean, no written data is in the clear, and the
// backing files are unchanged. A legacy AES image is shown read-only,
// with the reason in the log.
func TestEncryptedWritesThroughMount(t *testing.T) {
	src := harness.SourceDir(t)
	work := t.TempDir()
	images := qemu.EncryptedMatrix(t, src, qemu.WriteSpecs())
	kdir := qemu.KeyDir(t, src, images)
	keep := map[string][32]byte{}
	for _, f := range []string{"chain-base.qcow2", "plain-base.qcow2", "legacy-aes.qcow2"} {
		keep[f] = fileSHA(t, filepath.Join(src, f))
	}
	var writable []qemu.EncImage
	for _, e := range images {
		if !e.Legacy {
			writable = append(writable, e)
		}
	}
	all := newEncStates(t, work, writable, "mount ")

	m := harness.Racy.Mount(t, src, "--writable", "--key-dir", kdir)
	logMount = m
	defer func() { logMount = nil }()
	if _, err := os.OpenFile(filepath.Join(m.Dir, "legacy-aes.raw"), os.O_RDWR, 0); !errors.Is(err, syscall.EROFS) && !os.IsPermission(err) {
		t.Errorf("legacy AES opened for writing: %v", err)
	}
	writeEncStates(t, m.Dir, all)
	m.Unmount(t)
	if log := m.LogText(t); !strings.Contains(log, "legacy") {
		t.Errorf("the log does not say why legacy-aes.qcow2 is read-only:\n%s", log)
	}
	m.NoPanics(t)

	for _, s := range all {
		t.Run(s.e.Name, func(t *testing.T) {
			model := filepath.Join(work, s.e.Name+".model")
			os.WriteFile(model, s.model, 0o644)
			s.e.CompareRaw(t, model)
			s.e.CheckClean(t)
			harness.NotInClear(t, s.e.Path, s.clear)
		})
	}
	for f, sum := range keep {
		if fileSHA(t, filepath.Join(src, f)) != sum {
			t.Errorf("%s changed", f)
		}
	}
}

// TestEncryptedOverlay: with --overlay, the first write to an encrypted
// image makes its overlay LUKS-encrypted with the original's passphrase
// and cipher (also for a legacy AES original), as qemu-img create -b
// -o encrypt.format=luks would; qemu opens each overlay with the same
// secret (encrypt.key-secret and backing.encrypt.key-secret): compare
// equals the model, check is clean; no written data is in the clear; the
// originals are unchanged. A later mount picks the overlays up and
// reads the model through them.
func TestEncryptedOverlay(t *testing.T) {
	src := harness.SourceDir(t)
	work := t.TempDir()
	images := qemu.EncryptedMatrix(t, src, []qemu.LUKSSpec{{Cipher: "twofish-128", Mode: "cbc", Ivgen: "essiv", IvgenHash: "sha256", Hash: "sha512"}})
	kdir := qemu.KeyDir(t, src, images)
	sums := map[string][32]byte{}
	names, _ := filepath.Glob(filepath.Join(src, "*.qcow2"))
	for _, n := range names {
		sums[n] = fileSHA(t, n)
	}
	all := newEncStates(t, work, images, "overlay ")
	ov := filepath.Join(t.TempDir(), "overlays")

	m := harness.Racy.Mount(t, src, "--writable", "--overlay", ov, "--key-dir", kdir)
	logMount = m
	defer func() { logMount = nil }()
	writeEncStates(t, m.Dir, all)
	m.Unmount(t)
	m.NoPanics(t)
	for n, sum := range sums {
		if fileSHA(t, n) != sum {
			t.Errorf("the original %s changed", n)
		}
	}
	for _, s := range all {
		t.Run(s.e.Name, func(t *testing.T) {
			o := s.e
			o.Path = filepath.Join(ov, s.e.Name+".qcow2")
			o.Chain = append([]string{s.e.Chain[0]}, s.e.Chain...) // the overlay has the original's passphrase
			info := string(qemu.Img(t, "info", o.Path))
			if !strings.Contains(info, "format: luks") || !strings.Contains(info, "backing file: "+s.e.Path) {
				t.Errorf("the overlay is not a LUKS image over its original:\n%s", info)
			}
			if s.e.Spec.Cipher != "" && !strings.Contains(info, "cipher alg: "+s.e.Spec.Cipher) {
				t.Errorf("the overlay does not have its original's cipher %s:\n%s", s.e.Spec.Cipher, info)
			}
			model := filepath.Join(work, s.e.Name+".model")
			os.WriteFile(model, s.model, 0o644)
			o.CompareRaw(t, model)
			o.CheckClean(t)
			harness.NotInClear(t, o.Path, s.clear)
		})
	}
	// Mounted again, the overlays are picked up.
	m = harness.Mount(t, src, "--writable", "--overlay", ov, "--key-dir", kdir)
	for _, s := range all {
		got, err := os.ReadFile(filepath.Join(m.Dir, s.e.Name+".raw"))
		if err != nil || harness.FirstDiff(got, s.model) >= 0 {
			t.Errorf("%s: mounted again, it does not read as the model: %v", s.e.Name, err)
		}
	}
	if strings.Contains(m.Said, "not shown") {
		t.Errorf("mounted again: %s", m.Said)
	}
}

// TestEncryptedTempOverlay: with --overlay=temp and --key-dir alone, the
// throwaway overlay of an encrypted image is LUKS-encrypted and opens
// with its original's passphrase, found in --key-dir by the overlay's
// path below the throwaway folder (without that folder as a key root the
// overlay cannot open and the write fails); while mounted, qemu reads it
// (force-share, with the secret for it and its backing file) as the
// model, and the written data is not in the clear.
func TestEncryptedTempOverlay(t *testing.T) {
	src := harness.SourceDir(t)
	img := filepath.Join(src, "sub", "vm.qcow2")
	if err := os.MkdirAll(filepath.Dir(img), 0o755); err != nil {
		t.Fatal(err)
	}
	qemu.CreateLUKS(t, img, "temp pass", "8M", "")
	e := qemu.EncImage{Name: "vm", Path: img, Secrets: map[string]string{"vm.qcow2": "temp pass"}, Chain: []string{"vm.qcow2"}}
	kdir := qemu.KeyDir(t, src, []qemu.EncImage{e})
	t.Setenv("TMPDIR", t.TempDir()) // the daemon's throwaway folder
	m := harness.Mount(t, src, "--writable", "--overlay=temp", "--key-dir", kdir)
	data := bytes.Repeat([]byte("throwaway overlay, encrypted. "), 3000)
	f := harness.OpenFile(t, filepath.Join(m.Dir, "sub", "vm.raw"), os.O_RDWR)
	if _, err := f.WriteAt(data, 1<<20); err != nil {
		t.Fatalf("writing through the mount: %v", err)
	}
	if err := f.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	st, out := harness.StatusOf(t, m.Dir)
	if !st.TempOverlay {
		t.Fatalf("no throwaway overlays in qcowfs status:\n%s", out)
	}
	o := e
	o.Path = filepath.Join(st.Overlay, "sub", "vm.qcow2")
	o.Chain = []string{"vm.qcow2", "vm.qcow2"} // the overlay has the original's passphrase
	if info := string(qemu.Img(t, "info", "-U", o.Path)); !strings.Contains(info, "format: luks") || !strings.Contains(info, "backing file: "+img) {
		t.Errorf("the throwaway overlay is not a LUKS image over its original:\n%s", info)
	}
	model := make([]byte, 8<<20)
	copy(model[1<<20:], data)
	raw := filepath.Join(t.TempDir(), "model.raw")
	if err := os.WriteFile(raw, model, 0o644); err != nil {
		t.Fatal(err)
	}
	o.CompareRaw(t, raw, "force-share=on", "read-only=on")
	harness.NotInClear(t, o.Path, data[:64])
	m.Unmount(t)
	m.NoPanics(t)
}
