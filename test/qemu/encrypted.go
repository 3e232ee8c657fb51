package qemu

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
)

// Encrypted images made by qemu, and qemu's view of them given their
// secrets: qemu-img with `--object secret,id=kN,file=KEY` objects and
// `--image-opts driver=qcow2,file.filename=IMG,encrypt.key-secret=k0,
// backing.encrypt.key-secret=k1,...`.

// An EncImage is an encrypted image (or an image over an encrypted or
// plain backing file) with the passphrase of each file of its chain.
type EncImage struct {
	Name string // short, unique; the file is Name.qcow2
	Path string
	// Secrets maps the base name of each encrypted file of the chain,
	// top first in Chain, to its passphrase.
	Secrets map[string]string
	Chain   []string // base names, top first, of the files with secrets
	// Spec is the LUKS cipher specification ("" for legacy AES, and
	// for images not made by the cipher matrix).
	Spec LUKSSpec
	// Legacy is qemu's legacy AES format (read-only here).
	Legacy      bool
	ClusterSize int64
}

// A LUKSSpec is one cipher specification of qemu's encrypt.* options.
type LUKSSpec struct {
	Cipher, Mode, Ivgen, IvgenHash, Hash string
}

// Options are the spec as qemu-img create -o options.
func (s LUKSSpec) Options() string {
	o := "encrypt.cipher-alg=" + s.Cipher + ",encrypt.cipher-mode=" + s.Mode + ",encrypt.ivgen-alg=" + s.Ivgen + ",encrypt.hash-alg=" + s.Hash
	if s.IvgenHash != "" {
		o += ",encrypt.ivgen-hash-alg=" + s.IvgenHash
	}
	return o
}

// Name is the spec as a file name stem: aes-256-xts-essiv-sha256-sha1.
func (s LUKSSpec) Name() string {
	n := s.Cipher + "-" + s.Mode + "-" + s.Ivgen
	if s.IvgenHash != "" {
		n += "-" + s.IvgenHash
	}
	return n + "-" + s.Hash
}

// LUKSSpecs are every cipher, mode and IV generator qemu 7.2 can create
// an image with, other than serpent (which qcowfs refuses): 78. (qemu
// 7.2 aborts creating AES-192 and Twofish-192 in any mode but XTS, and has
// no CAST5 in XTS nor with ESSIV; ESSIV's hash must give a key of the
// cipher's family, so md5 or sha256.) The PBKDF2 and anti-forensic
// hash goes round the seven qemu offers, so that every hash meets every
// IV generator.
func LUKSSpecs() []LUKSSpec {
	hashes := []string{"sha256", "sha1", "sha512", "md5", "sha224", "sha384", "ripemd160"}
	type cm struct{ cipher, mode string }
	var modes []cm
	for _, c := range []string{"aes-128", "aes-192", "aes-256", "twofish-128", "twofish-192", "twofish-256", "cast5-128"} {
		for _, m := range []string{"xts", "cbc", "ecb", "ctr"} {
			switch {
			case (c == "aes-192" || c == "twofish-192") && m != "xts":
				continue
			case c == "cast5-128" && m == "xts":
				continue
			}
			modes = append(modes, cm{c, m})
		}
	}
	var out []LUKSSpec
	i := 0
	for _, m := range modes {
		ivgens := [][2]string{{"plain", ""}, {"plain64", ""}, {"essiv", "md5"}, {"essiv", "sha256"}}
		if m.cipher == "cast5-128" {
			ivgens = ivgens[:2]
		}
		for _, iv := range ivgens {
			out = append(out, LUKSSpec{Cipher: m.cipher, Mode: m.mode, Ivgen: iv[0], IvgenHash: iv[1], Hash: hashes[i%len(hashes)]})
			i++
		}
	}
	return out
}

// WriteSpecs are LUKSSpecs to write through: each cipher, mode and IV
// generator at least once.
func WriteSpecs() []LUKSSpec {
	return []LUKSSpec{
		{"aes-128", "cbc", "essiv", "sha256", "sha1"},
		{"aes-192", "xts", "plain", "", "sha512"},
		{"aes-256", "ecb", "plain64", "", "md5"},
		{"twofish-256", "ctr", "plain64", "", "sha256"},
		{"twofish-128", "xts", "essiv", "md5", "ripemd160"},
		{"cast5-128", "cbc", "plain", "", "sha224"},
		{"cast5-128", "ctr", "plain64", "", "sha384"},
	}
}

// encWrites are the qemu-io commands that give each image data: patterns
// at unaligned offsets and across clusters, zeroed and discarded ranges,
// the last sector.
func encWrites(cs, size int64) []string {
	return []string{
		"write -P 0x11 0 4096",
		fmt.Sprintf("write -P 0x22 %d 300", cs-100),
		fmt.Sprintf("write -P 0x33 %d %d", 3*cs+7, 2*cs+11),
		fmt.Sprintf("write -P 0x44 %d %d", 8*cs, 4*cs),
		fmt.Sprintf("write -z %d %d", 9*cs, cs),
		fmt.Sprintf("write -z -u %d %d", 10*cs, cs),
		fmt.Sprintf("discard %d %d", 11*cs, cs),
		fmt.Sprintf("write -P 0x67 %d 512", size-512),
	}
}

// CreateLUKS makes a LUKS-encrypted image with passphrase pass (qemu's
// iter-time 10 ms, so that opening it is quick) and the extra -o options
// and arguments given.
func CreateLUKS(t testing.TB, path, pass, size, opts string, extra ...string) {
	t.Helper()
	key := secretFile(t, pass)
	o := "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10"
	if opts != "" {
		o += "," + opts
	}
	args := append([]string{"create", "-q", "-f", "qcow2", "--object", "secret,id=s0,file=" + key, "-o", o}, extra...)
	Img(t, append(args, path, size)...)
}

// secretFile writes pass to a fresh key file, for qemu.
func secretFile(t testing.TB, pass string) string {
	t.Helper()
	f, err := os.CreateTemp(t.TempDir(), "key")
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString(pass)
	f.Close()
	return f.Name()
}

// EncryptedMatrix makes in dir, each holding data written by qemu-io:
// an image per cipher specification of specs (64 KiB clusters); AES-256-XTS
// images at 512 B and 2 MiB clusters and with extended L2 entries
// (32 KiB); a chain of two encrypted images with different passphrases;
// an encrypted image over a plain one; qemu's legacy AES. Every image
// has its own passphrase ("pass-NAME"). Images are made in parallel
// (qemu-img create measures PBKDF2 for a second whatever the iter-time).
func EncryptedMatrix(t testing.TB, dir string, specs []LUKSSpec) []EncImage {
	t.Helper()
	var out []EncImage
	var mu sync.Mutex
	add := func(e EncImage) {
		mu.Lock()
		out = append(out, e)
		mu.Unlock()
	}
	luks := func(t testing.TB, name string, spec LUKSSpec, cs int64, opts string) {
		p := filepath.Join(dir, name+".qcow2")
		size := 24*cs + 3*512
		o := fmt.Sprintf("cluster_size=%d", cs)
		if spec.Cipher != "" {
			o += "," + spec.Options()
		}
		if opts != "" {
			o += "," + opts
		}
		CreateLUKS(t, p, "pass-"+name, fmt.Sprint(size), o)
		e := EncImage{Name: name, Path: p, Secrets: map[string]string{name + ".qcow2": "pass-" + name}, Chain: []string{name + ".qcow2"}, Spec: spec, ClusterSize: cs}
		e.IO(t, encWrites(cs, size)...)
		add(e)
	}
	jobs := map[string]func(testing.TB){}
	for _, s := range specs {
		jobs[s.Name()] = func(t testing.TB) { luks(t, s.Name(), s, 65536, "") }
	}
	def := LUKSSpec{Cipher: "aes-256", Mode: "xts", Ivgen: "plain64", Hash: "sha256"}
	jobs["luks-c512"] = func(t testing.TB) { luks(t, "luks-c512", def, 512, "") }
	jobs["luks-c2m"] = func(t testing.TB) { luks(t, "luks-c2m", def, 2<<20, "") }
	jobs["luks-extl2"] = func(t testing.TB) { luks(t, "luks-extl2", def, 32768, "extended_l2=on") }
	jobs["chain"] = func(t testing.TB) {
		// A chain: an encrypted base, an encrypted overlay with
		// another passphrase and cluster size.
		base := filepath.Join(dir, "chain-base.qcow2")
		CreateLUKS(t, base, "pass-chain-base", "4M", "")
		b := EncImage{Name: "chain-base", Path: base, Secrets: map[string]string{"chain-base.qcow2": "pass-chain-base"}, Chain: []string{"chain-base.qcow2"}}
		b.IO(t, "write -P 0x44 0 4M")
		top := filepath.Join(dir, "chain.qcow2")
		CreateLUKS(t, top, "pass-chain", "4M", "cluster_size=4096", "-b", "chain-base.qcow2", "-F", "qcow2")
		e := EncImage{Name: "chain", Path: top, Secrets: map[string]string{"chain.qcow2": "pass-chain", "chain-base.qcow2": "pass-chain-base"},
			Chain: []string{"chain.qcow2", "chain-base.qcow2"}, ClusterSize: 4096}
		e.IO(t, "write -P 0x55 8k 20k", "write -z 1M 4k", "write -P 0x56 3M 100k")
		add(e)
	}
	jobs["over-plain"] = func(t testing.TB) {
		plain := filepath.Join(dir, "plain-base.qcow2")
		Create(t, "qcow2", plain, "4M")
		IO(t, plain, "write -P 0x66 0 3M")
		over := filepath.Join(dir, "over-plain.qcow2")
		CreateLUKS(t, over, "pass-over-plain", "4M", "cluster_size=16384", "-b", "plain-base.qcow2", "-F", "qcow2")
		e := EncImage{Name: "over-plain", Path: over, Secrets: map[string]string{"over-plain.qcow2": "pass-over-plain"}, Chain: []string{"over-plain.qcow2"}, ClusterSize: 16384}
		e.IO(t, "write -P 0x77 5000 3000", "write -z 2M 64k")
		add(e)
	}
	jobs["legacy-aes"] = func(t testing.TB) {
		p := filepath.Join(dir, "legacy-aes.qcow2")
		key := secretFile(t, "pass-legacy-aes")
		Img(t, "create", "-q", "-f", "qcow2", "--object", "secret,id=s0,file="+key, "-o", "encrypt.format=aes,encrypt.key-secret=s0", p, "4M")
		e := EncImage{Name: "legacy-aes", Path: p, Secrets: map[string]string{"legacy-aes.qcow2": "pass-legacy-aes"}, Chain: []string{"legacy-aes.qcow2"}, Legacy: true, ClusterSize: 65536}
		e.IO(t, encWrites(65536, 4<<20)...)
		add(e)
	}
	parallel(t, jobs)
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	settle()
	return out
}

// parallel runs the jobs as parallel subtests of t (as many at once as
// go test's -parallel, GOMAXPROCS by default), or one after another if
// t is not a *testing.T.
func parallel(t testing.TB, jobs map[string]func(testing.TB)) {
	t.Helper()
	tt, ok := t.(*testing.T)
	if !ok {
		for _, j := range jobs {
			j(t)
		}
		return
	}
	tt.Run("make", func(t *testing.T) {
		for name, j := range jobs {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				j(t)
			})
		}
	})
	if tt.Failed() {
		tt.FailNow()
	}
}

// Args are the arguments of qemu-img cmd (or qemu-io, cmd "") for the
// image (a file, or an http(s) URL) given its secrets: one secret object per file of its chain,
// written to files in a temporary folder, and --image-opts naming them.
// extra options are appended to the image's (",backing.backing...").
func (e EncImage) Args(t testing.TB, cmd string, extra ...string) []string {
	t.Helper()
	var args []string
	if cmd != "" {
		args = append(args, cmd)
	}
	opts := "driver=qcow2,file.filename=" + e.Path
	if scheme, _, ok := strings.Cut(e.Path, "://"); ok {
		// A URL: qemu's curl driver.
		opts = "driver=qcow2,file.driver=" + scheme + ",file.url=" + e.Path
	}
	prefix := ""
	for i, name := range e.Chain {
		key := secretFile(t, e.Secrets[name])
		id := fmt.Sprintf("k%d", i)
		args = append(args, "--object", "secret,id="+id+",file="+key)
		opts += "," + prefix + "encrypt.key-secret=" + id
		prefix += "backing."
	}
	for _, x := range extra {
		opts += "," + x
	}
	return append(args, "--image-opts", opts)
}

// IO runs qemu-io commands on the image with its secrets.
func (e EncImage) IO(t testing.TB, cmds ...string) {
	t.Helper()
	Require(t, "qemu-io")
	args := e.Args(t, "")
	for _, c := range cmds {
		args = append(args, "-c", c)
	}
	Run(t, "qemu-io", args...)
}

// ToRaw converts the image to a raw file with qemu-img convert and the
// secrets.
func (e EncImage) ToRaw(t testing.TB, raw string) string {
	t.Helper()
	Img(t, append(e.Args(t, "convert"), "-O", "raw", raw)...)
	return raw
}

// Map is qemu-img map --output=json with the secrets.
func (e EncImage) Map(t testing.TB) []MapEntry {
	t.Helper()
	var m []MapEntry
	if err := json.Unmarshal(Img(t, append(e.Args(t, "map"), "--output=json")...), &m); err != nil {
		t.Fatalf("qemu-img map %s: %v", e.Path, err)
	}
	return m
}

// DataRuns are DataRuns with the secrets.
func (e EncImage) DataRuns(t testing.TB) [][2]int64 { return dataRuns(e.Map(t)) }

// CheckHoles is CheckHoles with the secrets, given the image as raw
// (ToRaw, made after the lseek walk that found data).
func (e EncImage) CheckHoles(t testing.TB, data [][2]int64, raw string) {
	t.Helper()
	checkHoles(t, e.Path, data, e.Map(t), raw)
}

// Check runs qemu-img check with the secrets; it returns the output and
// the error.
func (e EncImage) Check(t testing.TB, extra ...string) ([]byte, error) {
	t.Helper()
	return exec.Command("qemu-img", e.Args(t, "check", extra...)...).CombinedOutput()
}

// CheckClean fails the test unless qemu-img check with the secrets finds
// the image clean.
func (e EncImage) CheckClean(t testing.TB, extra ...string) {
	t.Helper()
	if out, err := e.Check(t, extra...); err != nil {
		t.Fatalf("qemu-img check %s: %v\n%s", e.Path, err, out)
	}
}

// CompareRaw runs qemu-img compare of the image, with its secrets,
// against the raw file raw; it fails the test unless they are identical.
func (e EncImage) CompareRaw(t testing.TB, raw string, extra ...string) {
	t.Helper()
	args := append(e.Args(t, "compare", extra...), "driver=raw,file.filename="+raw)
	if out, err := exec.Command("qemu-img", args...).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img compare %s %s: %v\n%s", e.Path, raw, err, out)
	}
}

// KeyDir writes a --key-dir for the images below root, a fresh folder that
// it returns: DIR/REL, REL being each encrypted file's path relative to
// root, holding its passphrase.
func KeyDir(t testing.TB, root string, images []EncImage) string {
	t.Helper()
	dir := t.TempDir()
	for _, e := range images {
		for name, pass := range e.Secrets {
			rel, err := filepath.Rel(root, filepath.Join(filepath.Dir(e.Path), name))
			if err != nil {
				t.Fatal(err)
			}
			p := filepath.Join(dir, rel)
			os.MkdirAll(filepath.Dir(p), 0o700)
			if err := os.WriteFile(p, []byte(pass), 0o600); err != nil {
				t.Fatal(err)
			}
		}
	}
	return dir
}
