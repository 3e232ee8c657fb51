package keys

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func write(t *testing.T, path, content string, mode os.FileMode) string {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), mode); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestReadFile: a key file's bytes are taken as they are, trailing
// newline included (as qemu takes a secret's file=; test/cli checks this
// against qemu itself), and what qemu refuses is refused with the reason.
func TestReadFile(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []struct {
		name, content, err string
	}{
		{"plain", "secret", ""},
		{"newline", "secret\n", ""},
		{"crlf", "secret\r\n", ""},
		{"empty", "", ""},
		{"utf8", "sécret 東", ""},
		{"noncharacter", "a\xef\xbf\xbeb", ""}, // U+FFFE: qemu takes it
		{"nul", "secret\x00tail", "NUL byte at offset 6"},
		{"latin1", "s\xe9cret", "not valid UTF-8"},
		{"surrogate", "a\xed\xa0\x80b", "not valid UTF-8"},
		{"too-large", strings.Repeat("k", MaxBytes+1), "longer than"},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := write(t, filepath.Join(dir, c.name), c.content, 0o600)
			got, err := ReadFile(p)
			if c.err != "" {
				if err == nil || !strings.Contains(err.Error(), c.err) {
					t.Fatalf("err = %v, want one saying %q", err, c.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != c.content || cap(got) != len(got) {
				t.Errorf("got %q (cap %d), want %q", got, cap(got), c.content)
			}
		})
	}
}

// TestReadPipe: a key from a pipe (--key-file /dev/stdin, <(...)).
func TestReadPipe(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	go func() { w.Write([]byte("from a pipe\n")); w.Close() }()
	got, err := Read(r, "pipe")
	r.Close()
	if err != nil || string(got) != "from a pipe\n" || cap(got) != len(got) {
		t.Fatalf("got %q (cap %d), %v", got, cap(got), err)
	}
}

// TestRing: which file's passphrase comes from where.
func TestRing(t *testing.T) {
	tmp := t.TempDir()
	src, over := filepath.Join(tmp, "src"), filepath.Join(tmp, "over")
	kdir := filepath.Join(tmp, "keys")
	write(t, filepath.Join(kdir, "vm.qcow2"), "vm-pass", 0o600)
	write(t, filepath.Join(kdir, "sub/disk.qcow2"), "disk-pass\n", 0o644)
	write(t, filepath.Join(kdir, "bad.qcow2"), "bad\x00", 0o600)
	write(t, filepath.Join(kdir, "remote/vm.qcow2"), "url-pass", 0o600)
	var warnings []string
	warnf := func(format string, args ...any) {
		warnings = append(warnings, strings.TrimSpace(strings.ReplaceAll(format, "%s", "")+strings.Repeat(" ", len(args))))
	}
	r, err := New([]byte("file-pass"), "/k/file", kdir, warnf)
	if err != nil {
		t.Fatal(err)
	}
	r.AddRoot(src)
	r.AddRoot(over)
	r.AddRoot("https://host/images/")
	for _, c := range []struct{ file, want, source string }{
		{src + "/vm.qcow2", "vm-pass", "--key-dir file " + kdir + "/vm.qcow2"},
		{src + "/sub/disk.qcow2", "disk-pass\n", "--key-dir file " + kdir + "/sub/disk.qcow2"},
		// A backing name as the library combines it: not cleaned.
		{src + "/sub/../vm.qcow2", "vm-pass", "--key-dir file " + kdir + "/vm.qcow2"},
		// The overlay of sub/disk.qcow2 has its passphrase.
		{over + "/sub/disk.qcow2", "disk-pass\n", "--key-dir file " + kdir + "/sub/disk.qcow2"},
		// No file in --key-dir: the --key-file.
		{src + "/other.qcow2", "file-pass", "--key-file /k/file"},
		// Outside the roots: the --key-file.
		{tmp + "/elsewhere.qcow2", "file-pass", "--key-file /k/file"},
		{src + "/../src2/vm.qcow2", "file-pass", "--key-file /k/file"},
		// A file qemu would refuse as a secret: no key.
		{src + "/bad.qcow2", "", "--key-dir file " + kdir + "/bad.qcow2: key file " + kdir + "/bad.qcow2: a NUL byte"},
		{"https://host/images/remote/vm.qcow2", "url-pass", "--key-dir file " + kdir + "/remote/vm.qcow2"},
		{"https://host/images/remote/vm.qcow2?X-Amz-Signature=<redacted>", "url-pass", "--key-dir file " + kdir + "/remote/vm.qcow2"},
		{"https://host/other/vm.qcow2", "file-pass", "--key-file /k/file"},
	} {
		got := r.Passphrase(c.file)
		if string(got) != c.want || (c.want == "") != (got == nil) {
			t.Errorf("Passphrase(%s) = %q, want %q", c.file, got, c.want)
		}
		if s := r.Source(c.file); !strings.HasPrefix(s, c.source) {
			t.Errorf("Source(%s) = %q, want %q...", c.file, s, c.source)
		}
	}
	if len(warnings) != 2 {
		t.Errorf("warnings: %q, want one for the group-readable file and one for the NUL", warnings)
	}
	// Each call a fresh copy: clearing one leaves the ring's.
	a := r.Passphrase(src + "/other.qcow2")
	clear(a)
	if b := r.Passphrase(src + "/other.qcow2"); string(b) != "file-pass" {
		t.Errorf("after clearing a copy: %q", b)
	}
	key := r.file
	r.Close()
	if string(key) != strings.Repeat("\x00", len("file-pass")) {
		t.Errorf("Close left %q", key)
	}
	if got := r.Passphrase(src + "/other.qcow2"); got != nil {
		t.Errorf("after Close: %q", got)
	}
}

// TestRingMessages: what a refusal says when the ring has no key.
func TestRingMessages(t *testing.T) {
	tmp := t.TempDir()
	kdir := filepath.Join(tmp, "keys")
	os.Mkdir(kdir, 0o700)
	none, _ := New(nil, "", "", nil)
	dirOnly, _ := New(nil, "", kdir, nil)
	dirOnly.AddRoot(tmp + "/src")
	for _, c := range []struct {
		r          *Ring
		file, want string
	}{
		{nil, "/x.qcow2", "give its passphrase with --key-file or --key-dir"},
		{none, "/x.qcow2", "give its passphrase with --key-file or --key-dir"},
		{dirOnly, tmp + "/src/a/x.qcow2", "--key-dir has no " + kdir + "/a/x.qcow2"},
		{dirOnly, tmp + "/base.qcow2", "it lies outside the source, so --key-dir does not name it"},
	} {
		if got := c.r.Source(c.file); !strings.HasPrefix(got, c.want) {
			t.Errorf("Source(%s) = %q, want %q...", c.file, got, c.want)
		}
		if p := c.r.Passphrase(c.file); p != nil {
			t.Errorf("Passphrase(%s) = %q, want none", c.file, p)
		}
	}
	if _, err := New(nil, "", filepath.Join(tmp, "missing"), nil); err == nil {
		t.Error("a missing --key-dir is accepted")
	}
}

// TestEmptyKeyFile: an empty key file is an empty passphrase (qemu makes
// and opens images with one), not the absence of one.
func TestEmptyKeyFile(t *testing.T) {
	r, err := New(nil, "/k/empty", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	if p := r.Passphrase("/x.qcow2"); p == nil || len(p) != 0 {
		t.Errorf("Passphrase = %v, want an empty, non-nil slice", p)
	}
}

func TestModeWarning(t *testing.T) {
	dir := t.TempDir()
	private := write(t, filepath.Join(dir, "private"), "k", 0o600)
	group := write(t, filepath.Join(dir, "group"), "k", 0o640)
	os.Chmod(group, 0o640)
	if w := ModeWarning(private); w != "" {
		t.Errorf("0600: %q", w)
	}
	if w := ModeWarning(group); !strings.Contains(w, "readable by group or others (mode 0640)") {
		t.Errorf("0640: %q", w)
	}
	if ws := DirWarnings(dir, 10); len(ws) != 1 {
		t.Errorf("DirWarnings: %q", ws)
	}
}
