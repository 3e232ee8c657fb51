package test

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/internal/mountinfo"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// qcowfsBin is the qcowfs binary under test, built once by TestMain.
var qcowfsBin string

// With QCOWFS_TEST_RACE=1 (make test sets it), a second binary is built
// with the race detector, raceBin. The tests whose daemons run concurrent
// requests (racyMount) mount with it; every such daemon writes race
// reports under raceDir (GORACE log_path), and TestMain fails the run if
// any appear. (Every test under -race would take many times as long.)
var raceBin, raceDir string

func TestMain(m *testing.M) {
	if h := os.Getenv(helperEnv); h != "" {
		os.Exit(runHelper(h))
	}
	dir, err := os.MkdirTemp("", "qcowfs-test-bin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	qcowfsBin = filepath.Join(dir, "qcowfs")
	builds := [][]string{{"build", "-o", qcowfsBin}}
	if os.Getenv("QCOWFS_TEST_RACE") == "1" {
		raceBin = filepath.Join(dir, "qcowfs-race")
		builds = append(builds, []string{"build", "-race", "-o", raceBin})
		raceDir = filepath.Join(dir, "race")
		os.Mkdir(raceDir, 0o755)
	}
	for _, args := range builds {
		build := exec.Command("go", append(args, "../cmd/qcowfs")...)
		build.Stdout, build.Stderr = os.Stdout, os.Stderr
		if err := build.Run(); err != nil {
			fmt.Fprintln(os.Stderr, "building qcowfs:", err)
			os.Exit(1)
		}
	}
	code := m.Run()
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

// requireFUSE fails (under CI) or skips the test unless it can mount:
// root, /dev/fuse, and qemu-utils for making images.
func requireFUSE(t testing.TB) {
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

// qcowfs runs the binary and returns its combined output and error.
func qcowfs(args ...string) (string, error) {
	out, err := exec.Command(qcowfsBin, args...).CombinedOutput()
	return string(out), err
}

// racyMount is an option of mountImages: the daemon is the race-detecting
// build when there is one (QCOWFS_TEST_RACE=1), for tests whose requests
// run concurrently in the daemon.
const racyMount = "\x00race"

// A mount is a live qcowfs mount made by a test.
type mount struct {
	Dir  string // the mount point
	Log  string // the daemon's log file
	Said string // what qcowfs mount printed (refused images, warnings)
}

// mountImages mounts src with `qcowfs mount` (as a daemon, the way users
// run it) and unmounts it when the test ends, even if it fails.
func mountImages(t testing.TB, src string, args ...string) *mount {
	t.Helper()
	requireFUSE(t)
	m := &mount{Dir: t.TempDir(), Log: filepath.Join(t.TempDir(), "qcowfs.log")}
	bin := qcowfsBin
	all := []string{"mount", "--log-file", m.Log, "--log-level", "debug"}
	for _, a := range args {
		if a == racyMount {
			if raceBin != "" {
				bin = raceBin
			}
			continue
		}
		all = append(all, a)
	}
	cmd := exec.Command(bin, append(all, src, m.Dir)...)
	if bin == raceBin {
		cmd.Env = append(os.Environ(), "GORACE=log_path="+filepath.Join(raceDir, "report")+" halt_on_error=0")
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("qcowfs mount %s: %v\n%s", src, err, out)
	}
	m.Said = string(out)
	t.Cleanup(func() { m.unmount(t) })
	return m
}

// unmount unmounts, detaching lazily if something still holds the mount
// so that a failing test cannot leave it behind.
func (m *mount) unmount(t testing.TB) {
	if !isMounted(m.Dir) {
		return
	}
	if out, err := qcowfs("unmount", m.Dir); err != nil {
		t.Logf("qcowfs unmount %s: %v %s; detaching", m.Dir, err, out)
		exec.Command("umount", "-l", m.Dir).Run()
	}
}

// logText returns the daemon's log so far.
func (m *mount) logText(t testing.TB) string {
	b, err := os.ReadFile(m.Log)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func isMounted(dir string) bool {
	m, err := mountinfo.At(dir)
	return err == nil && m != nil
}

// waitFor polls cond until it holds or the deadline passes: for conditions
// that an outside actor (the kernel, udev) makes true asynchronously.
func waitFor(t testing.TB, what string, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// sameFile compares two files byte by byte and reports the first
// difference. It reads only where either file has data (by lseek
// SEEK_DATA/SEEK_HOLE), so terabyte sparse files compare quickly; where
// both have holes, both read as zeros.
func sameFile(t testing.TB, got, want string) {
	t.Helper()
	a, err := os.Open(got)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := os.Open(want)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	sa, _ := a.Stat()
	sb, _ := b.Stat()
	if sa.Size() != sb.Size() {
		t.Fatalf("%s is %d bytes, %s is %d", got, sa.Size(), want, sb.Size())
	}
	size := sa.Size()
	// nextData is where f's next data at or after off starts (size if none).
	nextData := func(f *os.File, off int64) int64 {
		d, err := unix.Seek(int(f.Fd()), off, unix.SEEK_DATA)
		if err != nil {
			return size
		}
		return d
	}
	nextHole := func(f *os.File, off int64) int64 {
		h, err := unix.Seek(int(f.Fd()), off, unix.SEEK_HOLE)
		if err != nil {
			return size
		}
		return h
	}
	bufA, bufB := make([]byte, 1<<20), make([]byte, 1<<20)
	for off := int64(0); off < size; {
		start := min(nextData(a, off), nextData(b, off))
		if start >= size {
			return
		}
		end := max(nextHole(a, start), nextHole(b, start))
		for pos := start; pos < end; {
			n := min(int64(len(bufA)), end-pos)
			if _, err := a.ReadAt(bufA[:n], pos); err != nil && err != io.EOF {
				t.Fatalf("reading %s at %d: %v", got, pos, err)
			}
			if _, err := b.ReadAt(bufB[:n], pos); err != nil && err != io.EOF {
				t.Fatalf("reading %s at %d: %v", want, pos, err)
			}
			if !bytes.Equal(bufA[:n], bufB[:n]) {
				for i := range bufA[:n] {
					if bufA[i] != bufB[i] {
						t.Fatalf("%s differs from %s at byte %d: %#x != %#x", got, want, pos+int64(i), bufA[i], bufB[i])
					}
				}
			}
			pos += n
		}
		off = end
	}
}
