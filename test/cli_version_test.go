package test

// Command line tests: version and help.

import (
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestVersionHelp: version and help.
func TestVersionHelp(t *testing.T) {
	r := cliRun(t, "version")
	cliWantOK(t, "qcowfs version", r)
	if !regexp.MustCompile(`^qcowfs \S+\n$`).MatchString(r.stdout) || r.stderr != "" {
		t.Errorf("qcowfs version printed %q, %q; want \"qcowfs VERSION\\n\"", r.stdout, r.stderr)
	}
	if r2 := cliRun(t, "--version"); r2.code != 0 || r2.stdout != r.stdout {
		t.Errorf("qcowfs --version printed %q (status %d), qcowfs version %q", r2.stdout, r2.code, r.stdout)
	}

	// The version is set at build time with -ldflags -X main.version.
	bin := filepath.Join(t.TempDir(), "qcowfs")
	build := exec.Command("go", "build", "-ldflags", "-X main.version=v9.8.7-test", "-o", bin, "../cmd/qcowfs")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	r = cliRunCmd(t, exec.Command(bin, "version"))
	if r.code != 0 || r.stdout != "qcowfs v9.8.7-test\n" {
		t.Errorf("built with -X main.version=v9.8.7-test, qcowfs version printed %q (status %d)", r.stdout, r.code)
	}

	r = cliRun(t, "--help")
	cliWantOK(t, "qcowfs --help", r)
	for _, cmd := range []string{"mount", "unmount", "info", "version"} {
		if !regexp.MustCompile(`(?m)^\s+` + cmd + `\b`).MatchString(r.stdout) {
			t.Errorf("qcowfs --help does not list the %s command:\n%s", cmd, r.stdout)
		}
	}

	// Every flag of mount, and every -o option it documents.
	flags := []string{"-f", "--foreground", "--allow-other", "--l2-cache-size", "--log-level",
		"--log-file", "--debug", "-o", "--options"}
	options := []string{"ro", "allow_other", "l2_cache_size", "log_level", "log_file", "debug", "foreground"}
	r = cliRun(t, "mount", "--help")
	cliWantOK(t, "qcowfs mount --help", r)
	for _, f := range flags {
		if !regexp.MustCompile(`(^|[\s,])` + regexp.QuoteMeta(f) + `([\s=,]|$)`).MatchString(r.stdout) {
			t.Errorf("qcowfs mount --help does not mention %s:\n%s", f, r.stdout)
		}
	}
	for _, o := range options {
		if !regexp.MustCompile(`\b` + o + `\b`).MatchString(r.stdout) {
			t.Errorf("qcowfs mount --help does not mention -o %s", o)
		}
	}
	// The flags as the help spells them are the ones the parser takes:
	// with all of them, the error is about the missing source, not a
	// flag.
	nosuch := filepath.Join(t.TempDir(), "nosuch")
	args := []string{"mount", "-f", "--foreground", "--allow-other", "--l2-cache-size", "16M", "--log-level", "warn",
		"--log-file", filepath.Join(t.TempDir(), "log"), "--debug", "-o", "ro", "--options", "allow_other", nosuch, t.TempDir()}
	cliWantError(t, "qcowfs "+strings.Join(args, " "), cliRun(t, args...), "nosuch")
}
