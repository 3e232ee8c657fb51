package main

import (
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
)

// The check workload (issue 7): `qcowfs check IMG` against `qemu-img check
// IMG`, the tool whose output and exit statuses it follows. Both are
// commands, not mounts, so what is measured is the process itself: its wall
// time and its own peak RSS, caches dropped before each run. A check reads
// every L1, L2 and refcount table: the 1 TiB sparse image has a large,
// mostly empty L1 and refcount table, the fragmented one a full L2 table
// set.
//
// The peak RSS comes from GNU time (its wait4's ru_maxrss), not from the
// bench's own wait4: Go starts a child with CLONE_VM (vfork), and exec
// records the old mm's high-water mark, the bench's own, as the child's
// peak (fs/exec.c, exec_mmap), so ru_maxrss would never be below the
// bench's RSS. GNU time fork()s: its child starts from time's 1 MiB.

// checkExits names the exit statuses of qemu-img check, which qcowfs check
// shares; the bench's images are clean, so anything but 0 is a failure.
var checkExits = map[int]string{
	1: "the check could not complete",
	2: "corruptions found",
	3: "leaked clusters found",
}

// rssFormat makes GNU time print the peak RSS in KiB as its last line.
const rssFormat = "qcowfs-bench-maxrss-kib %M"

// checkWorkload checks copyImages[n], an image of issue 4's copies.
func checkWorkload(n int) *workload {
	ci := copyImages[n]
	return &workload{
		id: "check-" + ci.name, image: ci.name, who: []string{"qcowfs-check", "qemu-img-check"},
		title: "check of the " + ci.title + " image",
		metrics: []metric{{id: "time", unit: seconds, short: "check " + ci.short,
			title: "qcowfs check vs qemu-img check, " + ci.title}},
		measure: measureCheck,
		what: "`qcowfs check IMG` vs `qemu-img check IMG`, caches dropped before each; a non-zero exit " +
			"(2 corruptions, 3 leaks, 1 incomplete) fails the contestant. Peak RSS is the process's own, " +
			"as `/usr/bin/time -f %M` reports it, the largest of its runs.",
	}
}

// measureCheck drops the caches and checks the image with the contestant's
// command.
func measureCheck(b *bench, w *workload, c *contestant, e *exposure, run int) ([]sample, error) {
	img := filepath.Join(b.imageRoot(w), "img", w.image, w.image+".qcow2")
	name := b.cfg.bin
	if c.id == "qemu-img-check" {
		name = "qemu-img"
	}
	if err := b.dropCachesIfAllowed(); err != nil {
		return nil, err
	}
	r := b.run(&cmd{name: "time", args: []string{"-f", rssFormat, name, "check", img}, timeout: b.timeoutOf(w)})
	s := sample{metric: "time", seconds: r.elapsed.Seconds()}
	// time's own lines ("Command exited with non-zero status 2", the
	// RSS) follow the command's stderr.
	var stderr []string
	for _, line := range strings.Split(strings.TrimSpace(r.stderr), "\n") {
		if v, ok := strings.CutPrefix(line, strings.TrimSuffix(rssFormat, "%M")); ok {
			kib, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			s.rss = kib << 10
		} else if !strings.HasPrefix(line, "Command exited with non-zero status") {
			stderr = append(stderr, line)
		}
	}
	r.stderr = strings.Join(stderr, "\n")
	switch {
	case r.timedOut:
		s.timedOut = true
		return []sample{s}, fmt.Errorf("%w: %v", errTimedOut, r.err)
	case r.exitCode > 0:
		why := checkExits[r.exitCode]
		if why == "" {
			why = "unexpected exit status"
		}
		return []sample{s}, fmt.Errorf("exit status %d (%s): %s", r.exitCode, why, lastLines(r.stdout+"\n"+r.stderr, 2))
	case r.err != nil:
		return []sample{s}, r.err
	}
	if run == 1 {
		s.note = "exit 0: " + strings.TrimSuffix(firstLine(r.stdout), ".")
	}
	return []sample{s}, nil
}

// firstLine is the first non-empty line of s.
func firstLine(s string) string {
	for _, line := range strings.Split(s, "\n") {
		if t := strings.TrimSpace(line); t != "" {
			return t
		}
	}
	return ""
}
