package main

import (
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestProcessTag: a live process has a tag that stays the same; a dead
// one, reaped or a zombie not yet reaped, has none, so that the folder of
// throwaway overlays of a killed daemon is removed even where nothing
// reaps it.
func TestProcessTag(t *testing.T) {
	me, err := processTag(os.Getpid())
	if err != nil || !strings.HasPrefix(me, strconv.Itoa(os.Getpid())+"-") {
		t.Fatalf("processTag of this process: %q, %v", me, err)
	}
	if again, _ := processTag(os.Getpid()); again != me {
		t.Errorf("processTag changed: %q, then %q", me, again)
	}
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	if _, err := processTag(pid); err != nil {
		t.Errorf("processTag of a live child: %v", err)
	}
	cmd.Process.Kill()
	// Dead and not reaped: waitid with WNOWAIT waits for its death and
	// leaves the zombie.
	var info unix.Siginfo
	if err := unix.Waitid(unix.P_PID, pid, &info, unix.WEXITED|unix.WNOWAIT, nil); err != nil {
		t.Fatalf("waitid: %v", err)
	}
	if tag, err := processTag(pid); err == nil {
		t.Errorf("processTag of a zombie: %q; want an error", tag)
	}
	cmd.Wait()
	if tag, err := processTag(pid); err == nil {
		t.Errorf("processTag of a reaped process: %q; want an error", tag)
	}
}
