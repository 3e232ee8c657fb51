package main

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// A stalled command: qemu's curl driver sometimes stops asking for more
// (qemu-img convert of a URL, and qemu's export over curl, in the remote
// workloads), and then waits forever. Waiting out the timeout (15 to 30 s)
// measures nothing more than that it hangs, so a command of those
// workloads whose processes have read and written nothing for remoteStall
// is cut off then, as a timeout is: its time is a lower bound, and it is
// not run again. remoteStall is twice the curl driver's own request
// timeout (5 s): a driver that gives up on a request and retries it moves
// again within that.
const remoteStall = 10 * time.Second

// stallPoll is how often the command's I/O counters are read.
const stallPoll = time.Second

// stallOf is the stall cut-off of w's timed commands: the remote
// workloads', none elsewhere.
func stallOf(w *workload) time.Duration {
	if w.remote != nil {
		return remoteStall
	}
	return 0
}

// watchStall returns a channel closed once the processes of process group
// pgid have together read and written nothing (rchar + wchar, which count
// sockets and pipes too) for d; quit stops the watch.
func watchStall(pgid int, d time.Duration, quit <-chan struct{}) <-chan struct{} {
	ch := make(chan struct{})
	go func() {
		t := time.NewTicker(stallPoll)
		defer t.Stop()
		last, moved := groupIO(pgid), time.Now()
		for {
			select {
			case <-quit:
				return
			case now := <-t.C:
				if n := groupIO(pgid); n != last {
					last, moved = n, now
				} else if now.Sub(moved) >= d {
					close(ch)
					return
				}
			}
		}
	}()
	return ch
}

// groupIO is the bytes the live processes of process group pgid have read
// and written (their own, and those of children they have reaped).
func groupIO(pgid int) int64 {
	ents, _ := os.ReadDir("/proc")
	group := strconv.Itoa(pgid)
	var sum int64
	for _, e := range ents {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid pgrp ...: comm may hold spaces and
		// parentheses, so the fields are counted from its last ')'.
		i := strings.LastIndexByte(string(stat), ')')
		if i < 0 {
			continue
		}
		if f := strings.Fields(string(stat[i+1:])); len(f) < 3 || f[2] != group {
			continue
		}
		io, err := os.ReadFile(filepath.Join("/proc", e.Name(), "io"))
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(io), "\n") {
			k, v, ok := strings.Cut(line, ": ")
			if ok && (k == "rchar" || k == "wchar") {
				n, _ := strconv.ParseInt(v, 10, 64)
				sum += n
			}
		}
	}
	return sum
}
