package harness

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"testing"

	"golang.org/x/sys/unix"
)

// seekerEnv makes the test binary a Seeker (Main runs it instead of the
// tests): QCOWFS_TEST_SEEKER=PATH.
const seekerEnv = "QCOWFS_TEST_SEEKER"

// A Seeker is a caller the test can kill in the middle of a request: the
// test binary run again, which opens a file, says so, and asks
// lseek(SEEK_DATA) from 0 (its answer on its stdout, unread).
type Seeker struct {
	Cmd *exec.Cmd
	out *bufio.Reader
}

// StartSeeker starts a Seeker on path and returns once it has the file
// open (its lseek is then under way, or about to be). It is killed when
// the test ends.
func StartSeeker(t testing.TB, path string) *Seeker {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), seekerEnv+"="+path)
	cmd.Stderr = os.Stderr
	pipe, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	s := &Seeker{Cmd: cmd, out: bufio.NewReader(pipe)}
	if line, err := s.out.ReadString('\n'); line != "open\n" {
		t.Fatalf("the seeker on %s: %q, %v", path, line, err)
	}
	return s
}

// runSeeker is the Seeker's process.
func runSeeker(path string) int {
	fd, err := unix.Open(path, unix.O_RDONLY, 0)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println("open")
	off, err := unix.Seek(fd, 0, unix.SEEK_DATA)
	fmt.Println(off, err)
	return 0
}
