package harness

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/qcowfs/qcowfs/test/qemu"
)

// bin is the qcowfs binary under test, built once by Main.
var bin string

// With QCOWFS_TEST_RACE=1 (make test sets it), a second binary is built
// with the race detector, raceBin. The tests whose daemons run concurrent
// requests (Racy) mount with it; every such daemon writes race reports
// under raceDir (GORACE log_path), and Main fails the run if any appear.
// (Every test under -race would take many times as long.)
var raceBin, raceDir string

// Main is the TestMain of every end-to-end package: it builds the qcowfs
// binary (and with QCOWFS_TEST_RACE=1 its race-detecting build) once for
// the package's run, runs the tests, fails the run if a racy daemon
// reported a race, and exits.
func Main(m *testing.M) {
	if path := os.Getenv(seekerEnv); path != "" {
		os.Exit(runSeeker(path))
	}
	dir, err := os.MkdirTemp("", "qcowfs-test-bin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bin = filepath.Join(dir, "qcowfs")
	builds := [][]string{{"build", "-o", bin}}
	if os.Getenv("QCOWFS_TEST_RACE") == "1" {
		raceBin = filepath.Join(dir, "qcowfs-race")
		builds = append(builds, []string{"build", "-race", "-o", raceBin})
		raceDir = filepath.Join(dir, "race")
		os.Mkdir(raceDir, 0o755)
	}
	for _, args := range builds {
		build := exec.Command("go", append(args, "github.com/qcowfs/qcowfs/cmd/qcowfs")...)
		build.Stdout, build.Stderr = os.Stdout, os.Stderr
		if err := build.Run(); err != nil {
			fmt.Fprintln(os.Stderr, "building qcowfs:", err)
			os.Exit(1)
		}
	}
	restore, err := setUringParam()
	if err != nil {
		// Under CI the kernel must have it; elsewhere the run over
		// the ring is skipped, saying why.
		fmt.Fprintln(os.Stderr, err)
		if os.Getenv("CI") != "true" {
			fmt.Fprintln(os.Stderr, "skipping this package's run over FUSE over io_uring")
			os.RemoveAll(dir)
			os.Exit(0)
		}
		os.Exit(1)
	}
	code := m.Run()
	restore()
	if raceDir != "" {
		reports, _ := filepath.Glob(filepath.Join(raceDir, "report*"))
		for _, r := range reports {
			b, _ := os.ReadFile(r)
			fmt.Fprintf(os.Stderr, "the race detector reported, in %s:\n%s\n", r, b)
			code = 1
		}
	}
	os.RemoveAll(dir)
	os.Exit(code)
}

// Bin is the path of the qcowfs binary under test.
func Bin() string { return bin }

// MemBound is a memory bound of mib MiB, in KiB, for a binary built as
// the tests build it: the race detector (make test) roughly triples what
// a program takes.
func MemBound(mib int64) int64 {
	if raceDir != "" {
		mib *= 3
	}
	return mib << 10
}

// RequireFUSE fails (under CI) or skips the test unless it can mount:
// root, /dev/fuse, and qemu-utils for making images.
func RequireFUSE(t testing.TB) {
	t.Helper()
	fail := t.Skipf
	if os.Getenv("CI") == "true" {
		fail = t.Fatalf
	}
	if os.Geteuid() != 0 {
		fail("needs root")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		fail("needs /dev/fuse: %v", err)
	}
	qemu.Require(t, "qemu-img", "qemu-io")
}

// SourceDir is a fresh folder for the images a test mounts, or serves for
// a remote mount (qemu.TempDir), once RequireFUSE has passed: a machine
// that cannot mount skips or fails the test before any image is made.
func SourceDir(t testing.TB) string {
	t.Helper()
	RequireFUSE(t)
	return qemu.TempDir(t)
}

// Root is the folder of the qcowfs module (go.mod, README.md, the
// Makefile), for the tests of what it holds: the first folder from the
// test's own up that has a go.mod.
func Root(t testing.TB) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		if filepath.Dir(dir) == dir {
			t.Fatal("no go.mod above the test's folder")
		}
		dir = filepath.Dir(dir)
	}
}
