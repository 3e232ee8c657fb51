package cli

// Command line tests of encrypted images: --key-file and --key-dir as
// qemu reads secrets, the refusals, and info, map and check with keys
// against qemu-img with the secrets.

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// qemuOpens reports whether qemu opens the LUKS image img (unlocking it)
// with the key file key as a secret object's file=.
func qemuOpens(t *testing.T, img, key string) (bool, string) {
	t.Helper()
	out, err := exec.Command("qemu-io", "-r", "--object", "secret,id=s0,file="+key, "--image-opts",
		"driver=qcow2,file.filename="+img+",encrypt.key-secret=s0", "-c", "read 0 512").CombinedOutput()
	return err == nil, string(out)
}

// TestKeyFileAsQemuReadsIt: a key file's bytes are the passphrase as qemu
// takes them. Images made by qemu with "secret" and with "secret\n" are
// shown by a mount whose key file holds the same bytes, and not shown
// ("wrong passphrase", naming --key-file) by one whose key file differs
// by the newline, exactly where qemu-io with the same key file opens or
// refuses them; the refusal of a key file ending in a newline says that
// the newline is part of the passphrase, and to write the file with
// printf %s (in the mount's lines, a single image's failure, info). A key
// file that qemu refuses as a secret (not UTF-8, a NUL byte) is refused
// by the mount, with the reason. --key-file
// /dev/stdin works: the daemon gets the bytes from the process that read
// them.
func TestKeyFileAsQemuReadsIt(t *testing.T) {
	src := harness.SourceDir(t)
	keys := t.TempDir()
	passes := map[string]string{"plain": "secret", "newline": "secret\n"}
	keyFiles := map[string]string{}
	for name, pass := range passes {
		keyFiles[name] = writeFile(t, filepath.Join(keys, name), pass)
		os.Chmod(keyFiles[name], 0o600)
		qemu.CreateLUKS(t, filepath.Join(src, name+".qcow2"), pass, "1M", "")
	}
	for keyName, key := range keyFiles {
		t.Run("key-"+keyName, func(t *testing.T) {
			m := harness.Mount(t, src, "--key-file", key)
			for img := range passes {
				opens, _ := qemuOpens(t, filepath.Join(src, img+".qcow2"), key)
				_, err := os.Stat(filepath.Join(m.Dir, img+".raw"))
				shown := err == nil
				if shown != opens {
					t.Errorf("key %q, image %q: shown %v, qemu opens it %v\n%s", passes[keyName], passes[img], shown, opens, m.Said)
				}
				line := "not shown: " + filepath.Join(src, img+".qcow2") + ": encrypted: wrong passphrase (--key-file " + key + newlineHint(passes[keyName]) + ")"
				if n := strings.Count(m.Said, line); n != map[bool]int{true: 0, false: 1}[opens] {
					t.Errorf("qcowfs mount said %d times %q:\n%s", n, line, m.Said)
				}
			}
		})
	}
	// A single image, and info, whose key file's newline makes the
	// passphrase wrong: the hint too.
	plain := filepath.Join(src, "plain.qcow2")
	mnt := t.TempDir()
	harness.Cleanup(t, mnt)
	r := harness.Run(t, "mount", "--key-file", keyFiles["newline"], plain, mnt)
	harness.WantError(t, "qcowfs mount of a single image with a key file ending in a newline", r,
		plain, "wrong passphrase", "--key-file "+keyFiles["newline"]+newlineHint("\n"))
	// (info describes the image from its header, with a warning line.)
	r = harness.Run(t, "info", "--key-file", keyFiles["newline"], plain)
	if !strings.Contains(r.Stderr, "wrong passphrase (--key-file "+keyFiles["newline"]+newlineHint("\n")+")") {
		t.Errorf("qcowfs info with a key file ending in a newline says %q", r.Stderr)
	}
	// What qemu refuses as a secret, the mount refuses, naming why.
	for _, c := range []struct{ name, content, word string }{
		{"nul", "secret\x00", "NUL byte"},
		{"latin1", "s\xe9cret", "not valid UTF-8"},
	} {
		key := writeFile(t, filepath.Join(keys, c.name), c.content)
		os.Chmod(key, 0o600)
		if ok, out := qemuOpens(t, filepath.Join(src, "plain.qcow2"), key); ok || !strings.Contains(out, "not valid UTF-8") {
			t.Fatalf("qemu takes the key %q: %s", c.content, out)
		}
		mnt := t.TempDir()
		harness.Cleanup(t, mnt)
		r := harness.Run(t, "mount", "--key-file", key, src, mnt)
		harness.WantError(t, "qcowfs mount --key-file "+c.name, r, "--key-file", key, c.word)
	}
	// The key on stdin: the daemon's stdin is /dev/null, so it must get
	// the bytes from its parent.
	mnt = t.TempDir()
	harness.Cleanup(t, mnt)
	cmd := exec.Command(harness.Bin(), "mount", "--key-file", "/dev/stdin", src, mnt)
	cmd.Stdin = strings.NewReader("secret\n")
	r = harness.RunCmd(t, cmd)
	harness.WantOK(t, "qcowfs mount --key-file /dev/stdin", r)
	if _, err := os.Stat(filepath.Join(mnt, "newline.raw")); err != nil {
		t.Errorf("with the key on stdin: %v\n%s", err, r.Stderr)
	}
	harness.Run(t, "unmount", mnt)
}

// newlineHint is what a message adds to "wrong passphrase (--key-file
// KEY" when the key file's bytes, pass, end in a newline: that the
// newline is part of the passphrase, and how to write a file without.
func newlineHint(pass string) string {
	if !strings.HasSuffix(pass, "\n") {
		return ""
	}
	return "; the key file ends in a newline, which is part of the passphrase, as qemu reads it too; to leave it out, write the file with printf %s, not echo"
}

// TestKeyRefusals: an image whose key is wrong or missing is not shown,
// with one "not shown:" line naming the image, "wrong passphrase" or "no
// key given", and the flag; the other images are served; a single image
// mount fails. The key never appears in what qcowfs says, its log (at
// debug level), its status, or the daemon's core limit (0).
func TestKeyRefusals(t *testing.T) {
	src := harness.SourceDir(t)
	const passA, passB = "Passphrase-A-7d1f", "Passphrase-B-93c2"
	a, b := filepath.Join(src, "a.qcow2"), filepath.Join(src, "sub", "b.qcow2")
	os.Mkdir(filepath.Join(src, "sub"), 0o755)
	qemu.CreateLUKS(t, a, passA, "1M", "")
	qemu.CreateLUKS(t, b, passB, "1M", "")
	qemu.Create(t, "qcow2", filepath.Join(src, "plain.qcow2"), "1M")
	keys := t.TempDir()
	keyA := writeFile(t, filepath.Join(keys, "a"), passA)
	os.Chmod(keyA, 0o600)
	kdir := filepath.Join(keys, "dir")
	os.MkdirAll(filepath.Join(kdir, "sub"), 0o700)
	os.WriteFile(filepath.Join(kdir, "a.qcow2"), []byte(passA), 0o600)

	for _, c := range []struct {
		name    string
		args    []string
		shown   []string
		refused map[string]string // image -> the rest of its line
	}{
		{"no key", nil, []string{"plain.raw"}, map[string]string{
			a: "encrypted: no key given (give its passphrase with --key-file or --key-dir)",
			b: "encrypted: no key given (give its passphrase with --key-file or --key-dir)"}},
		{"key-file", []string{"--key-file", keyA}, []string{"a.raw", "plain.raw"}, map[string]string{
			b: "encrypted: wrong passphrase (--key-file " + keyA + ")"}},
		{"key-dir", []string{"--key-dir", kdir}, []string{"a.raw", "plain.raw"}, map[string]string{
			b: "encrypted: no key given (--key-dir has no " + filepath.Join(kdir, "sub/b.qcow2")}},
		{"option", []string{"-o", "key_dir=" + kdir + ",key_file=" + keyA}, []string{"a.raw", "plain.raw"}, map[string]string{
			b: "encrypted: wrong passphrase (--key-file " + keyA + ")"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			m := harness.Mount(t, src, c.args...)
			for _, s := range c.shown {
				if _, err := os.Stat(filepath.Join(m.Dir, s)); err != nil {
					t.Errorf("%s not shown: %v", s, err)
				}
			}
			for img, rest := range c.refused {
				rel, _ := filepath.Rel(src, img)
				if _, err := os.Stat(filepath.Join(m.Dir, strings.TrimSuffix(rel, ".qcow2")+".raw")); err == nil {
					t.Errorf("%s is shown", img)
				}
				line := "qcowfs: not shown: " + img + ": " + rest
				if n := strings.Count(m.Said, line); n != 1 {
					t.Errorf("qcowfs mount said %q %d times:\n%s", line, n, m.Said)
				}
			}
			if n := strings.Count(m.Said, "not shown:"); n != len(c.refused) {
				t.Errorf("%d not shown lines, want %d:\n%s", n, len(c.refused), m.Said)
			}
			_, status := harness.StatusOf(t, m.Dir)
			for _, text := range []string{m.Said, m.LogText(t), status} {
				if strings.Contains(text, passA) || strings.Contains(text, passB) {
					t.Errorf("a passphrase appears in:\n%s", text)
				}
			}
			if c.args != nil {
				limits, err := os.ReadFile(fmt.Sprintf("/proc/%d/limits", m.PID(t)))
				if err != nil || !regexp.MustCompile(`Max core file size\s+0\s+0`).Match(limits) {
					t.Errorf("the daemon holding keys may dump core:\n%s", limits)
				}
			}
			m.NoPanics(t)
		})
	}

	// A single image: the mount fails, naming the reason and the flag.
	for _, c := range []struct {
		args  []string
		words []string
	}{
		{nil, []string{b, "encrypted: no key given", "--key-file"}},
		{[]string{"--key-file", keyA}, []string{b, "encrypted: wrong passphrase", "--key-file " + keyA}},
		{[]string{"--foreground", "--key-file", keyA}, []string{b, "encrypted: wrong passphrase", "--key-file " + keyA}},
	} {
		mnt := t.TempDir()
		harness.Cleanup(t, mnt)
		start := time.Now()
		r := harness.Run(t, append(append([]string{"mount"}, c.args...), b, mnt)...)
		harness.WantError(t, "qcowfs mount "+strings.Join(c.args, " ")+" "+b, r, c.words...)
		if harness.MountAt(t, mnt) != nil {
			t.Errorf("%v: mounted", c.args)
		}
		if d := time.Since(start); d > 30*time.Second {
			t.Errorf("%v: took %v", c.args, d)
		}
	}
}

// TestKeyFileWarning: a key file (or a --key-dir file) that group or
// others may read gets a warning line, from mount and from info.
func TestKeyFileWarning(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "qemu-img")
	src := qemu.TempDir(t)
	img := filepath.Join(src, "vm.qcow2")
	qemu.CreateLUKS(t, img, "pw", "1M", "")
	key := writeFile(t, filepath.Join(t.TempDir(), "key"), "pw")
	os.Chmod(key, 0o644)
	kdir := t.TempDir()
	os.WriteFile(filepath.Join(kdir, "vm.qcow2"), []byte("pw"), 0o640)
	os.Chmod(filepath.Join(kdir, "vm.qcow2"), 0o640)
	want := "readable by group or others"
	m := harness.Mount(t, src, "--key-file", key)
	if !strings.Contains(m.Said, "qcowfs: warning: key file "+key+" is "+want) {
		t.Errorf("no warning for a key file of mode 0644:\n%s", m.Said)
	}
	m = harness.Mount(t, src, "--key-dir", kdir)
	if !strings.Contains(m.Said, "key file "+filepath.Join(kdir, "vm.qcow2")+" is "+want) {
		t.Errorf("no warning for a --key-dir file of mode 0640:\n%s", m.Said)
	}
	r := harness.Run(t, "info", "--key-file", key, img)
	harness.WantOK(t, "qcowfs info", r)
	if !strings.Contains(r.Stderr, want) {
		t.Errorf("qcowfs info: no warning: %q", r.Stderr)
	}
	os.Chmod(key, 0o600)
	if m := harness.Mount(t, src, "--key-file", key); strings.Contains(m.Said, want) {
		t.Errorf("a warning for a key file of mode 0600:\n%s", m.Said)
	}
}

// TestEncryptedInfoMapCheck: qcowfs info, map and check with the keys
// print what qemu-img prints given the secrets (--object secret
// --image-opts): info as qemu-img info (human and JSON, --backing-chain;
// qemu-img's "image:" names the --image-opts, so info is compared with
// qemu-img info of the file, which is the same but for that); map as
// qemu-img map (JSON; the human form refuses encrypted clusters in both);
// check as qemu-img check (the JSON "filename" aside). With a wrong key,
// map and check fail naming it, and info describes the image from its
// header as qemu-img does, with a warning.
func TestEncryptedInfoMapCheck(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	dir := qemu.TempDir(t)
	images := qemu.EncryptedMatrix(t, dir, []qemu.LUKSSpec{{Cipher: "aes-128", Mode: "cbc", Ivgen: "essiv", IvgenHash: "sha256", Hash: "sha1"}})
	// A snapshot, which qemu-img info lists: only an opened image can.
	snap := images[0]
	qemu.Run(t, "qemu-img", append(snap.Args(t, "snapshot"), "-c", "s1")...)
	kdir := qemu.KeyDir(t, dir, images)
	filename := regexp.MustCompile(`(?m)^    "filename": ".*",\n`)
	for _, e := range images {
		t.Run(e.Name, func(t *testing.T) {
			keys := []string{"--key-dir", kdir}
			for _, args := range [][]string{
				{"info"}, {"info", "--output=json"}, {"info", "--backing-chain"}, {"info", "--backing-chain", "--output=json"},
			} {
				q := harness.Exec(t, "qemu-img", append(args, e.Path)...)
				us := harness.Run(t, append(append(args, keys...), e.Path)...)
				harness.SameAsQemu(t, strings.Join(args, " "), q, us)
			}
			for _, args := range [][]string{{"map", "--output=json"}, {"map"}, {"check"}, {"check", "--output=json"}} {
				q := harness.Exec(t, "qemu-img", append(e.Args(t, args[0]), args[1:]...)...)
				us := harness.Run(t, append(append(args, keys...), e.Path)...)
				q.Stdout = filename.ReplaceAllString(q.Stdout, "")
				us.Stdout = filename.ReplaceAllString(us.Stdout, "")
				harness.SameAsQemu(t, strings.Join(args, " "), q, us)
			}
			if e.Legacy {
				return // a wrong key opens it (noise), in qemu too
			}
			bad := writeFile(t, filepath.Join(t.TempDir(), "bad"), "not the passphrase")
			os.Chmod(bad, 0o600)
			for _, cmd := range []string{"map", "check"} {
				r := harness.Run(t, cmd, "--key-file", bad, e.Path)
				harness.WantError(t, "qcowfs "+cmd+" with a wrong key", r, "wrong passphrase", "--key-file "+bad)
			}
			q := harness.Exec(t, "qemu-img", "info", "--output=json", e.Path)
			r := harness.Run(t, "info", "--output=json", "--key-file", bad, e.Path)
			if r.Code != 0 || !strings.Contains(r.Stderr, "warning: "+e.Path) || !strings.Contains(r.Stderr, "wrong passphrase") {
				t.Errorf("info with a wrong key: exit %d, %q", r.Code, r.Stderr)
			}
			var a, b map[string]any
			json.Unmarshal([]byte(q.Stdout), &a)
			json.Unmarshal([]byte(r.Stdout), &b)
			delete(a, "snapshots") // (described from the header only)
			if d := jsonDiff(a, b); d != "" {
				t.Errorf("info with a wrong key: %s", d)
			}
		})
	}
}

func jsonDiff(a, b map[string]any) string {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	if string(x) != string(y) {
		return string(x) + "\n" + string(y)
	}
	return ""
}
