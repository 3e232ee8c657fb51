package cli

// Command line tests: version and help, and the README's flag table
// against the parser.

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
)

// TestVersion: qcowfs version prints the version, the Go version, the
// go-fuse version of go.mod and the inflater; --version the first line.
func TestVersion(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(harness.Root(t), "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^\s*github.com/hanwen/go-fuse/v2 (v\S+)`).FindSubmatch(b)
	if m == nil {
		t.Fatal("go.mod does not require github.com/hanwen/go-fuse/v2")
	}
	fuseVersion := string(m[1])
	if r := regexp.MustCompile(`(?m)^replace github.com/hanwen/go-fuse/v2 => (\S+)$`).FindSubmatch(b); r != nil {
		fuseVersion += " => " + string(r[1]) // third_party/go-fuse
	}
	goVersion, err := exec.Command("go", "env", "GOVERSION").Output()
	if err != nil {
		t.Fatal(err)
	}
	build := func(version string, cgo bool) string {
		bin := filepath.Join(t.TempDir(), "qcowfs")
		cmd := exec.Command("go", "build", "-ldflags", "-X main.version="+version, "-o", bin, filepath.Join(harness.Root(t), "cmd/qcowfs"))
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if cgo {
			cmd.Env = append(os.Environ(), "CGO_ENABLED=1")
		}
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go build: %v\n%s", err, out)
		}
		return bin
	}
	for _, cgo := range []bool{true, false} {
		bin := build("v9.8.7-test", cgo)
		inflate := "compress/flate (built without cgo)"
		if cgo {
			inflate = "libdeflate"
		}
		want := "qcowfs v9.8.7-test\ngo: " + strings.TrimSpace(string(goVersion)) + "\ngo-fuse: " + fuseVersion + "\ndeflate: " + inflate + "\n"
		r := harness.RunCmd(t, exec.Command(bin, "version"))
		if r.Code != 0 || r.Stdout != want || r.Stderr != "" {
			t.Errorf("cgo %v: qcowfs version printed %q, %q (status %d), want %q", cgo, r.Stdout, r.Stderr, r.Code, want)
		}
		r = harness.RunCmd(t, exec.Command(bin, "--version"))
		if r.Code != 0 || r.Stdout != "qcowfs v9.8.7-test\n" {
			t.Errorf("qcowfs --version printed %q (status %d)", r.Stdout, r.Code)
		}
	}
}

// helpFlags returns the long flags a --help page lists, with their
// placeholder ("SIZE", "" for a bool flag).
func helpFlags(help string) map[string]string {
	flags := map[string]string{}
	for _, m := range regexp.MustCompile(`(?m)^\s+(?:-\w, )?--([a-z0-9-]+)(?:=("?)([^\s"]*)"?)?`).FindAllStringSubmatch(help, -1) {
		flags[m[1]] = m[3]
	}
	return flags
}

// TestHelp: every command is listed and has examples, --version is
// mentioned once, every size flag shows its default, and qcowfs help CMD
// is qcowfs CMD --help.
func TestHelp(t *testing.T) {
	r := harness.Run(t, "--help")
	harness.WantOK(t, "qcowfs --help", r)
	top := r.Stdout
	for _, cmd := range []string{"mount", "unmount", "status", "info", "map", "check", "version", "help"} {
		if !regexp.MustCompile(`(?m)^\s+` + cmd + `\b`).MatchString(top) {
			t.Errorf("qcowfs --help does not list the %s command:\n%s", cmd, top)
		}
		r := harness.Run(t, cmd, "--help")
		harness.WantOK(t, "qcowfs "+cmd+" --help", r)
		if !strings.Contains(r.Stdout, "Examples:") {
			t.Errorf("qcowfs %s --help has no examples:\n%s", cmd, r.Stdout)
		}
		if n := strings.Count(r.Stdout, "--version"); n != 0 && cmd != "version" && cmd != "help" {
			t.Errorf("qcowfs %s --help mentions --version %d times, want 0 (it is the version command's)", cmd, n)
		}
		if h := harness.Run(t, "help", cmd); h.Stdout != r.Stdout || h.Code != 0 {
			t.Errorf("qcowfs help %s printed %q (status %d), qcowfs %s --help %q", cmd, h.Stdout, h.Code, cmd, r.Stdout)
		}
	}
	if n := strings.Count(top, "--version"); n != 1 {
		t.Errorf("qcowfs --help mentions --version %d times, want once", n)
	}
	for _, want := range []string{"Exit status", "2 a usage mistake"} {
		if !strings.Contains(top, want) {
			t.Errorf("qcowfs --help does not document the exit status (%q)", want)
		}
	}

	r = harness.Run(t, "mount", "--help")
	flags := helpFlags(r.Stdout)
	for _, f := range []string{"foreground", "allow-other", "l2-cache-size", "cache-size", "read-ahead", "log-file", "allow-backing-outside", "options"} {
		if _, ok := flags[f]; !ok {
			t.Errorf("qcowfs mount --help does not list --%s", f)
		}
	}
	for f, ph := range flags {
		if ph == "SIZE" && !regexp.MustCompile(`--`+f+`=SIZE\s[^-]*?\(default: \d+[KMGT]?\)`).MatchString(strings.Join(strings.Fields(r.Stdout), " ")) {
			t.Errorf("qcowfs mount --help: --%s does not show its default", f)
		}
	}

	// The flags as the help spells them are the ones the parser takes,
	// as flags and as -o options: with all of them, the error is about
	// the missing source, not a flag.
	nosuch := filepath.Join(t.TempDir(), "nosuch")
	key := filepath.Join(t.TempDir(), "key") // --key-file's FILE: read before the source is looked at
	if err := os.WriteFile(key, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	value := map[string]string{"SIZE": "16M", "PATH": filepath.Join(t.TempDir(), "f"), "DIR": t.TempDir(), "NAME": "x",
		"splice": "copy", "auto": "off", "info": "warn", "URL": "http://127.0.0.1:9", "REGION": "us-east-1", "N": "4", "DURATION": "5s", "RATE": "50M",
		"FILE": key}
	args := []string{"mount"}
	var opts []string
	for f, ph := range flags {
		// (--force-share and --writable exclude each other: the
		// writable one stays.)
		if f == "help" || f == "options" || f == "foreground" || f == "force-share" {
			continue
		}
		if ph == "" {
			args = append(args, "--"+f)
			opts = append(opts, strings.ReplaceAll(f, "-", "_"))
			continue
		}
		v, ok := value[ph]
		if !ok {
			t.Fatalf("no test value for --%s=%s", f, ph)
		}
		args = append(args, "--"+f+"="+v)
		opts = append(opts, strings.ReplaceAll(f, "-", "_")+"="+v)
	}
	for _, a := range [][]string{append(args, nosuch, t.TempDir()), {"mount", "-o", strings.Join(opts, ","), nosuch, t.TempDir()}} {
		r := harness.Run(t, a...)
		harness.WantError(t, "qcowfs "+strings.Join(a, " "), r, "nosuch")
		if r.Code != 1 {
			t.Errorf("qcowfs %s: exit status %d, want 1 (a missing source is no usage mistake)", strings.Join(a, " "), r.Code)
		}
	}
}

// TestREADMEFlags: the README's table of mount flags has a row for every
// flag of qcowfs mount --help, with the -o option it is, and no row for a
// flag that does not exist.
func TestREADMEFlags(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(harness.Root(t), "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	rows := map[string]string{}
	for _, m := range regexp.MustCompile("(?m)^\\| (?:`-\\w`, )?`--([a-z0-9-]+)[^`]*` \\| (?:`([a-z0-9_]+)[^`]*`)? *\\|").FindAllStringSubmatch(string(b), -1) {
		rows[m[1]] = m[2]
	}
	r := harness.Run(t, "mount", "--help")
	flags := helpFlags(r.Stdout)
	for f := range flags {
		if f == "help" || f == "options" {
			continue
		}
		opt, ok := rows[f]
		if !ok {
			t.Errorf("README's flag table has no row for --%s", f)
			continue
		}
		if want := strings.ReplaceAll(f, "-", "_"); opt != want {
			t.Errorf("README: --%s is -o %q, want %q", f, opt, want)
		}
	}
	for f := range rows {
		if _, ok := flags[f]; !ok {
			t.Errorf("README lists --%s, which qcowfs mount --help does not", f)
		}
	}
}

// TestManPage: qcowfs help-man is a man page groff reads without a
// warning, with every command and every flag that --help lists; make
// install puts it and the binary in place and make uninstall removes both.
func TestManPage(t *testing.T) {
	if _, err := exec.LookPath("groff"); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("groff is required under CI=true (package groff-base)")
		}
		t.Skip("groff not installed")
	}
	r := harness.Run(t, "help-man")
	harness.WantOK(t, "qcowfs help-man", r)
	page := filepath.Join(t.TempDir(), "qcowfs.1")
	writeFile(t, page, r.Stdout)
	render := exec.Command("groff", "-man", "-Tutf8", "-ww", "-P-cbou", page)
	render.Env = append(os.Environ(), "MANWIDTH=200", "COLUMNS=200")
	res := harness.RunCmd(t, render)
	if res.Code != 0 || res.Stderr != "" {
		t.Fatalf("groff: status %d: %s", res.Code, res.Stderr)
	}
	text := strings.Join(strings.Fields(res.Stdout), " ")
	text = strings.ReplaceAll(text, "‐ ", "") // hyphenation at line ends
	for _, cmd := range []string{"mount", "unmount", "status", "info", "map", "check", "version", "help"} {
		if !strings.Contains(text, "qcowfs "+cmd) {
			t.Errorf("the man page has no qcowfs %s", cmd)
		}
		h := harness.Run(t, cmd, "--help")
		for f := range helpFlags(h.Stdout) {
			if f != "help" && !strings.Contains(text, "--"+f) {
				t.Errorf("the man page does not document qcowfs %s --%s", cmd, f)
			}
		}
	}

	dest := t.TempDir()
	make := func(target string) {
		cmd := exec.Command("make", "-C", harness.Root(t), target, "DESTDIR="+dest, "PREFIX=/usr/local")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("make %s: %v\n%s", target, err, out)
		}
	}
	make("install")
	bin, man := filepath.Join(dest, "usr/local/bin/qcowfs"), filepath.Join(dest, "usr/local/share/man/man1/qcowfs.1")
	for _, p := range []string{bin, man} {
		if st, err := os.Stat(p); err != nil || st.Size() == 0 {
			t.Errorf("make install: %s: %v", p, err)
		}
	}
	if b, _ := os.ReadFile(man); !strings.Contains(string(b), ".TH QCOWFS 1") {
		t.Errorf("make install: %s is not the man page", man)
	}
	make("uninstall")
	for _, p := range []string{bin, man} {
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("make uninstall left %s: %v", p, err)
		}
	}
}
