package hostile

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

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
	harness.RequireFUSE(t)
	qemu.Require(t, "qemu-img", "qemu-io")
	src := qemu.TempDir(t)
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
