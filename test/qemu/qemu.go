// Package qemu wraps the reference tools (qemu-img, qemu-io) for tests, so
// a test reads as "make this image with qemu, read it with us, compare with
// qemu". qemu is the oracle: expectations come from these tools, never from
// the code under test.
package qemu

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// Require fails the test (under CI, where every tool must be installed) or
// skips it (elsewhere) when a tool is missing from PATH.
func Require(t testing.TB, tools ...string) {
	t.Helper()
	if err := preloadCPUClock(); err != nil && os.Getenv("CI") == "true" {
		t.Fatal(err)
	}
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("%s is required under CI=true: %v", tool, err)
			}
			t.Skipf("%s not installed: %v", tool, err)
		}
	}
}

// Run runs a command and fails the test if it fails; it returns stdout.
//
// qemu-img's "Unable to get accurate CPU usage" (cpuclock.go), and only
// that failure, is retried, up to 50 times: where the getrusage shim
// could not be built, the retries stand in for it.
func Run(t testing.TB, name string, args ...string) []byte {
	t.Helper()
	if err := preloadCPUClock(); err != nil && os.Getenv("CI") == "true" {
		t.Fatal(err)
	}
	for try := 1; ; try++ {
		var stdout, stderr bytes.Buffer
		cmd := exec.Command(name, args...)
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		if err == nil {
			return stdout.Bytes()
		}
		if try == 50 || !strings.Contains(stderr.String(), "Unable to get accurate CPU usage") {
			t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, stderr.String())
		}
		t.Logf("%s: %s (try %d)", name, strings.TrimSpace(stderr.String()), try)
	}
}

// Img runs qemu-img with args.
func Img(t testing.TB, args ...string) []byte {
	t.Helper()
	Require(t, "qemu-img")
	return Run(t, "qemu-img", args...)
}

// Create makes an image: Create(t, "qcow2", path, "64M", "-o", "cluster_size=4096").
func Create(t testing.TB, format, path, size string, extra ...string) {
	t.Helper()
	args := append([]string{"create", "-q", "-f", format}, extra...)
	Img(t, append(args, path, size)...)
}

// Make creates a qcow2 image of size at path and writes it with qemu-io,
// each of writes one command ("write -P 0x61 0 1M"); it returns path.
func Make(t testing.TB, path, size string, writes ...string) string {
	t.Helper()
	Create(t, "qcow2", path, size)
	if len(writes) > 0 {
		IO(t, path, writes...)
	}
	return path
}

// CreateEncrypted makes a 1 MiB qcow2 image encrypted with format "luks"
// or "aes", with the passphrase "123456".
func CreateEncrypted(t testing.TB, path, format string) {
	t.Helper()
	Img(t, "create", "-q", "-f", "qcow2", "--object", "secret,id=s0,data=123456",
		"-o", "encrypt.format="+format+",encrypt.key-secret=s0", path, "1M")
}

// IO runs qemu-io commands (each one a "-c" argument) on a qcow2 image.
func IO(t testing.TB, image string, cmds ...string) {
	t.Helper()
	formatIO(t, "qcow2", image, cmds...)
}

// formatIO runs qemu-io commands on a file of the given format.
func formatIO(t testing.TB, format, path string, cmds ...string) {
	t.Helper()
	Require(t, "qemu-io")
	args := []string{"-f", format}
	for _, c := range cmds {
		args = append(args, "-c", c)
	}
	Run(t, "qemu-io", append(args, path)...)
}

// ToRaw converts image to a raw file with qemu-img convert and returns the
// raw file's path.
func ToRaw(t testing.TB, image, raw string) string {
	t.Helper()
	Img(t, "convert", "-O", "raw", image, raw)
	return raw
}

// RawBytes is what qemu-img convert -O raw makes of image: the bytes a
// mount of it must read.
func RawBytes(t testing.TB, image string) []byte {
	t.Helper()
	b, err := os.ReadFile(ToRaw(t, image, filepath.Join(t.TempDir(), "image.raw")))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// Info returns `qemu-img info --output=json` for image, decoded.
func Info(t testing.TB, image string) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(Img(t, "info", "--output=json", image), &m); err != nil {
		t.Fatalf("qemu-img info %s: %v", image, err)
	}
	return m
}

// MapEntry is one extent of `qemu-img map --output=json`.
type MapEntry struct {
	Start      int64  `json:"start"`
	Length     int64  `json:"length"`
	Depth      int    `json:"depth"`
	Present    bool   `json:"present"`
	Zero       bool   `json:"zero"`
	Data       bool   `json:"data"`
	Compressed *bool  `json:"compressed,omitempty"`
	Offset     *int64 `json:"offset,omitempty"`
}

// Map returns `qemu-img map --output=json` for image, decoded.
func Map(t testing.TB, image string) []MapEntry {
	t.Helper()
	var m []MapEntry
	if err := json.Unmarshal(Img(t, "map", "--output=json", image), &m); err != nil {
		t.Fatalf("qemu-img map %s: %v", image, err)
	}
	return m
}

// DataRuns are where qemu-img map says image (a file or a URL) does not
// read as zeros: its extents not "zero", adjacent ones merged, [start,
// end) each.
func DataRuns(t testing.TB, image string) [][2]int64 {
	t.Helper()
	return dataRuns(Map(t, image))
}

// dataRuns are the extents of a map that are not "zero", merged.
func dataRuns(m []MapEntry) [][2]int64 {
	var runs [][2]int64
	for _, e := range m {
		if e.Zero {
			continue
		}
		if n := len(runs); n > 0 && runs[n-1][1] == e.Start {
			runs[n-1][1] += e.Length
			continue
		}
		runs = append(runs, [2]int64{e.Start, e.Start + e.Length})
	}
	return runs
}

// CheckClean runs qemu-img check on image and fails the test unless it
// finds no errors, no leaks and no corruption.
func CheckClean(t testing.TB, image string) {
	t.Helper()
	out, err := exec.Command("qemu-img", "check", "--output=json", image).Output()
	var res struct {
		CheckErrors int `json:"check-errors"`
		Corruptions int `json:"corruptions"`
		Leaks       int `json:"leaks"`
	}
	if jerr := json.Unmarshal(out, &res); jerr != nil || err != nil || res.CheckErrors+res.Corruptions+res.Leaks != 0 {
		human, _ := exec.Command("qemu-img", "check", image).CombinedOutput()
		t.Fatalf("qemu-img check %s: %v %v %+v\n%s", image, err, jerr, res, human)
	}
}

// Major is the installed qemu-img's major version (qemu 8.0 changed what
// info and map print).
func Major(t testing.TB) int {
	t.Helper()
	m := regexp.MustCompile(`version (\d+)\.`).FindSubmatch(Img(t, "--version"))
	if m == nil {
		t.Fatal("qemu-img --version names no version")
	}
	n, _ := strconv.Atoi(string(m[1]))
	return n
}
