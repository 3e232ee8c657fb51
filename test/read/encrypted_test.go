package read

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestEncryptedThroughMount mounts the encrypted matrix (every cipher,
// mode, IV generator and hash qemu 7.2 makes that qcowfs reads; 512 B,
// 64 KiB and 2 MiB clusters; extended L2; a chain of two encrypted images
// with different passphrases; an encrypted image over a plain one;
// legacy AES), each image with its own passphrase in --key-dir but one,
// whose passphrase is the --key-file. For each: cmp of the raw file and
// qemu-img convert with the secrets; the lseek walk against qemu-img map
// with the secrets; qcowfs info --output=json with the key against
// qemu-img info, byte for byte, and its encrypt block against qemu-img
// info's with the secrets.
func TestEncryptedThroughMount(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "qemu-img", "qemu-io", "cmp")
	src := qemu.TempDir(t)
	images := qemu.EncryptedMatrix(t, src, qemu.LUKSSpecs())
	keys := filepath.Join(t.TempDir(), "keys")
	qemu.KeyDir(t, keys, src, images)
	// luks-c512's passphrase comes from --key-file: none in --key-dir.
	os.Remove(filepath.Join(keys, "luks-c512.qcow2"))
	keyFile := filepath.Join(t.TempDir(), "key")
	os.WriteFile(keyFile, []byte("pass-luks-c512"), 0o600)

	m := harness.Racy.Mount(t, src, "--key-dir", keys, "--key-file", keyFile)
	if strings.Contains(m.Said, "not shown") {
		t.Fatalf("qcowfs mount refused images:\n%s", m.Said)
	}
	out := t.TempDir()
	for _, e := range images {
		t.Run(e.Name, func(t *testing.T) {
			p := filepath.Join(m.Dir, e.Name+".raw")
			f, err := os.Open(p)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			st, _ := f.Stat()
			runs := harness.SeekRuns(t, f, st.Size())
			raw := e.ToRaw(t, filepath.Join(out, e.Name+".raw"))
			defer os.Remove(raw)
			e.CheckHoles(t, runs, raw)
			if b, err := exec.Command("cmp", p, raw).CombinedOutput(); err != nil {
				t.Fatalf("cmp: %v\n%s", err, b)
			}

			// info, with the key (the image opened), as qemu-img
			// info prints it; and its encrypt block as qemu's with
			// the secrets.
			r := harness.Run(t, "info", "--output=json", "--key-dir", keys, "--key-file", keyFile, e.Path)
			harness.WantOK(t, "qcowfs info", r)
			if r.Stderr != "" {
				t.Errorf("qcowfs info says %q", r.Stderr)
			}
			if q := string(qemu.Img(t, "info", "--output=json", e.Path)); r.Stdout != q {
				t.Errorf("qcowfs info:\n%s\nqemu-img info:\n%s", r.Stdout, q)
			}
			var us, them struct {
				FormatSpecific struct {
					Data struct {
						Encrypt map[string]any `json:"encrypt"`
					} `json:"data"`
				} `json:"format-specific"`
				Encrypted bool `json:"encrypted"`
			}
			r.JSON(t, &us)
			top := e // (qemu-img info opens no backing file)
			top.Chain = e.Chain[:1]
			if err := json.Unmarshal(qemu.Img(t, append(top.Args(t, "info"), "--output=json")...), &them); err != nil {
				t.Fatal(err)
			}
			if !us.Encrypted || us.FormatSpecific.Data.Encrypt == nil || !reflect.DeepEqual(us, them) {
				t.Errorf("encrypt block: qcowfs %+v, qemu-img with the secrets %+v", us, them)
			}
		})
	}
	m.NoPanics(t)
}
