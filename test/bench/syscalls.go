package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Host system calls, counted (issues 4 and 5): issue 4 asks how many lseek
// and FIEMAP calls on the image a sparse copy costs, issue 5 how many read
// calls per compressed cluster a sequential read costs (target: below
// 0.1, i.e. one read serves ten clusters or more). After a workload's
// timed runs, its command runs once more per traced daemon, with strace
// attached to the daemon:
//
//	strace -f -c -q -U name,calls -o OUT -P IMG -e trace=lseek,ioctl,pread64,read,preadv,preadv2 -p PID
//
// -f -p attaches every thread of the daemon (Go's, qemu's thread pool) and
// follows new ones. -P IMG keeps only the calls on the image file: a FUSE
// daemon read(2)s every request from /dev/fuse, and those would swamp the
// count. strace stops the daemon at every system call, whether it is
// counted or not, which slows it several fold: the pass is untimed, and
// comes after the timed runs. strace is stopped with SIGINT once the
// command has ended; it then detaches and writes its summary (-c).
//
// The traced daemon is a fresh mount, not the one of the timed runs: a
// daemon keeps what it learnt (qcowfs the image's host extents and L2
// tables, qemu its L2 cache) across copies, and one that has served the
// timed runs copies the 1 GiB fragmented image with no FIEMAP call at all,
// where a fresh one makes thousands. The count is that of a first copy
// after mounting, which is how an image is copied out.

// tracedSyscalls are the calls counted. ioctl stands for FIEMAP: it is the
// only ioctl qcowfs makes on an image.
var tracedSyscalls = []string{"lseek", "ioctl", "pread64", "read", "preadv", "preadv2"}

// readSyscalls are the tracedSyscalls that read the image.
var readSyscalls = []string{"pread64", "read", "preadv", "preadv2"}

// tracedDaemons are the contestants whose daemon can be traced: qcowfs,
// and qemu's export for comparison, in the configuration the plan runs
// everywhere (the tuned one). Each pass says which of them it traces.
var tracedDaemons = []string{"qcowfs", "qemu-tuned"}

// A passKind says what a syscall pass reports.
type passKind int

const (
	perCopy              passKind = iota // lseek and FIEMAP calls of one copy
	perCompressedCluster                 // read calls of one cold read of a compressed image, per compressed cluster
)

// A syscallPass is a workload's untimed strace run: what it reports, whose
// daemons it traces (those of them that take part), and the workload's
// command, run once (as run 0: no first-run checks).
type syscallPass struct {
	kind    passKind
	who     []string
	measure func(b *bench, w *workload, c *contestant, e *exposure, run int) ([]sample, error)
}

// copySyscalls counts the lseek and FIEMAP calls of one more copy by each
// of who.
func copySyscalls(who ...string) *syscallPass {
	return &syscallPass{kind: perCopy, who: who, measure: measureCopy}
}

// compressedReadSyscalls counts the read calls of one more cold dd of a
// compressed image, by qcowfs. Not by qemu's export: it reads once per
// cluster (1.005 on deflate, 1.013 on zstd in the full runs up to
// 2026-12-02, docs/benchmarks.md), and its traced dd took 33 to 35 s.
func compressedReadSyscalls() *syscallPass {
	return &syscallPass{kind: perCompressedCluster, who: []string{"qcowfs"}, measure: measureDDCold}
}

// A syscallCount is what one traced run counted, as written to the JSON
// file.
type syscallCount struct {
	Workload   string           `json:"workload"`
	Contestant string           `json:"contestant"`
	Calls      map[string]int64 `json:"calls,omitempty"` // per system call, on the image file
	Lseek      int64            `json:"lseek"`
	Ioctl      int64            `json:"ioctl"` // FIEMAP, for qcowfs
	Reads      int64            `json:"reads"` // pread64 + read + preadv + preadv2
	// CompressedClusters is the image's count (qemu-img check), for
	// reads per compressed cluster.
	CompressedClusters int64   `json:"compressed_clusters,omitempty"`
	ReadsPerCluster    float64 `json:"reads_per_compressed_cluster,omitempty"`
	Seconds            float64 `json:"traced_seconds"` // the command's wall time under strace: not a measurement
	Error              string  `json:"error,omitempty"`
}

// countSyscalls runs w's syscall pass for every traced daemon that ran all
// the timed runs, each on a mount of its own.
func (b *bench) countSyscalls(w *workload, res *wlResult) {
	if _, err := exec.LookPath("strace"); err != nil {
		res.syscallsNote = "n/a: strace is not installed (package strace)"
		return
	}
	var clusters int64
	if w.syscalls.kind == perCompressedCluster {
		n, err := b.compressedClusters(imageByName(w.image))
		if err != nil {
			res.syscallsNote = "n/a: counting the compressed clusters: " + err.Error()
			return
		}
		clusters = n
	}
	// The traced command runs under the bench's default timeout: the
	// cap of hopeless contestants (they are not traced) would cut off a
	// daemon that strace slows down.
	untimed := *w
	untimed.timeout = 0
	for _, id := range w.who {
		c := contestantByID(id)
		if !slices.Contains(w.syscalls.who, id) || res.status[id] != "" || c.expose == nil || b.ctx.Err() != nil {
			continue
		}
		sc := b.traceOnce(&untimed, c, clusters)
		res.syscalls = append(res.syscalls, sc)
		if sc.Error != "" {
			fmt.Printf("   %-20s strace: %s\n", c.label, sc.Error)
		} else {
			fmt.Printf("   %-20s strace: %s (untimed, %.1f s)\n", c.label, describeCount(w.syscalls.kind, sc), sc.Seconds)
		}
	}
}

// traceOnce exposes w's image through c afresh, runs the pass's command
// once with strace attached to the daemon, and tears the mount down.
func (b *bench) traceOnce(w *workload, c *contestant, clusters int64) syscallCount {
	sc := syscallCount{Workload: w.id, Contestant: c.id, CompressedClusters: clusters}
	im := imageByName(w.image)
	e, err := c.expose(b, im, b.imageRoot(w))
	if err != nil {
		sc.Error = "mounting: " + err.Error()
		return sc
	}
	e.c = c
	defer func() {
		for j := len(e.undos) - 1; j >= 0; j-- {
			b.undo(e.undos[j])
		}
	}()
	// The stat opens the image (qcowfs opens it on first use): the
	// count starts with the copy, on a daemon that has read the header.
	if err := b.checkExposed(e, mustSize(b, im)); err != nil {
		sc.Error = err.Error()
		return sc
	}
	if e.pid == 0 {
		sc.Error = "the daemon's pid is not known"
		return sc
	}
	img, err := filepath.EvalSymlinks(filepath.Join(b.imageRoot(w), "img", w.image, w.image+".qcow2"))
	if err != nil {
		sc.Error = err.Error()
		return sc
	}
	t, err := b.attachStrace(e.pid, img)
	if err != nil {
		sc.Error = err.Error()
		return sc
	}
	samples, merr := w.syscalls.measure(b, w, c, e, 0)
	calls, serr := t.detach(b)
	if len(samples) > 0 {
		sc.Seconds = samples[len(samples)-1].seconds
	}
	switch {
	case merr != nil:
		sc.Error = "the traced run failed: " + merr.Error()
		return sc
	case serr != nil:
		sc.Error = serr.Error()
		return sc
	}
	sc.Calls = calls
	sc.Lseek, sc.Ioctl = calls["lseek"], calls["ioctl"]
	for _, name := range readSyscalls {
		sc.Reads += calls[name]
	}
	if clusters > 0 {
		sc.ReadsPerCluster = float64(sc.Reads) / float64(clusters)
	}
	return sc
}

// A tracer is a running strace attached to a daemon.
type tracer struct {
	pc     *exec.Cmd
	out    string // its -c summary
	stderr *capBuffer
	exited chan struct{}
	stop   *undo
}

// attachStrace attaches strace to every thread of pid, counting the
// tracedSyscalls on the file at path, and returns once it is attached.
func (b *bench) attachStrace(pid int, path string) (*tracer, error) {
	dir := filepath.Join(b.cfg.work, "strace")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	out := filepath.Join(dir, strconv.Itoa(pid)+".txt")
	os.Remove(out)
	args := []string{"-f", "-c", "-q", "-U", "name,calls", "-o", out, "-P", path,
		"-e", "trace=" + strings.Join(tracedSyscalls, ","), "-p", strconv.Itoa(pid)}
	t := &tracer{pc: exec.Command("strace", args...), out: out, stderr: &capBuffer{max: 64 << 10}, exited: make(chan struct{})}
	t.pc.Stderr = t.stderr
	// Its own process group: the terminal's Ctrl-C must not stop it
	// before the bench does.
	t.pc.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	fmt.Fprintf(b.log, "%s $ %s &\n", time.Now().Format("15:04:05.000"), shellQuote(append([]string{"strace"}, args...)))
	if err := t.pc.Start(); err != nil {
		return nil, err
	}
	go func() { t.pc.Wait(); close(t.exited) }()
	t.stop = b.push(fmt.Sprintf("stop strace %d", t.pc.Process.Pid), func() error {
		t.pc.Process.Signal(syscall.SIGINT)
		select {
		case <-t.exited:
			return nil
		case <-time.After(30 * time.Second):
		}
		t.pc.Process.Kill()
		<-t.exited
		return fmt.Errorf("strace %d ignored SIGINT for 30 s; killed", t.pc.Process.Pid)
	})
	gone := func() bool {
		select {
		case <-t.exited:
			return true
		default:
			return false
		}
	}
	attached := b.waitUntil(b.ctx, 20*time.Second, func() bool { return gone() || tracedBy(pid, t.pc.Process.Pid) })
	if gone() || !attached {
		b.undo(t.stop)
		why := lastLines(t.stderr.String(), 2)
		if why == "" {
			why = "not attached after 20 s"
		}
		return nil, fmt.Errorf("strace -p %d: %s", pid, why)
	}
	return t, nil
}

// detach stops strace and returns its counts per system call.
func (t *tracer) detach(b *bench) (map[string]int64, error) {
	if err := b.undo(t.stop); err != nil {
		return nil, err
	}
	data, err := os.ReadFile(t.out)
	if err != nil {
		return nil, fmt.Errorf("strace wrote no summary (%v): %s", err, lastLines(t.stderr.String(), 2))
	}
	os.Remove(t.out)
	return parseStraceSummary(string(data))
}

// parseStraceSummary reads strace's -c -U name,calls table:
//
//	syscall              calls
//	---------------- ---------
//	ioctl                 2550
//	---------------- ---------
//	total                 2550
//
// No calls at all leave it empty.
func parseStraceSummary(text string) (map[string]int64, error) {
	calls := map[string]int64{}
	for _, line := range strings.Split(text, "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || strings.HasPrefix(f[0], "---") || f[0] == "syscall" || f[0] == "total" {
			continue
		}
		if len(f) != 2 {
			return nil, fmt.Errorf("strace summary: unexpected line %q", line)
		}
		n, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("strace summary: unexpected line %q", line)
		}
		calls[f[0]] = n
	}
	return calls, nil
}

// tracedBy reports whether every thread of pid is traced by tracer.
func tracedBy(pid, tracer int) bool {
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/status", pid))
	if len(tasks) == 0 {
		return false
	}
	for _, p := range tasks {
		data, err := os.ReadFile(p)
		if err != nil {
			continue // the thread has exited
		}
		for _, line := range strings.Split(string(data), "\n") {
			if v, ok := strings.CutPrefix(line, "TracerPid:"); ok && strings.TrimSpace(v) != strconv.Itoa(tracer) {
				return false
			}
		}
	}
	return true
}

// compressedClusters is the number of compressed clusters of im, as
// `qemu-img check --output=json` counts them; asked once per image and
// run. -U: the image is open in the workload's exports.
func (b *bench) compressedClusters(im *image) (int64, error) {
	if n, ok := b.compressed[im.name]; ok {
		return n, nil
	}
	out, err := b.must(&cmd{name: "qemu-img", args: []string{"check", "-U", "--output=json", b.qcowPath(im.name)}, timeout: 5 * time.Minute})
	if err != nil {
		return 0, err
	}
	var c struct {
		Compressed *int64 `json:"compressed-clusters"`
	}
	if err := json.Unmarshal([]byte(out), &c); err != nil {
		return 0, fmt.Errorf("qemu-img check --output=json: %v", err)
	}
	if c.Compressed == nil || *c.Compressed <= 0 {
		return 0, fmt.Errorf("qemu-img check counts no compressed clusters in %s", im.name)
	}
	b.compressed[im.name] = *c.Compressed
	return *c.Compressed, nil
}

// describeCount is a traced run's result in a few words.
func describeCount(k passKind, sc syscallCount) string {
	if k == perCompressedCluster {
		return fmt.Sprintf("%d read calls on the image for %d compressed clusters: %.3f per cluster", sc.Reads, sc.CompressedClusters, sc.ReadsPerCluster)
	}
	return fmt.Sprintf("%d lseek, %d ioctl (FIEMAP), %d read calls on the image", sc.Lseek, sc.Ioctl, sc.Reads)
}

// syscallNote explains the counts under each table of them.
var syscallNote = "Counted by `strace -f -c -p PID -P IMG -e trace=" + strings.Join(tracedSyscalls, ",") + "` attached to the daemon " +
	"of a fresh mount for one more run of the workload's command after the timed runs (caches dropped first, as before every timed run): " +
	"the calls of a first copy or read after mounting, on the image file only (not the daemon's reads of /dev/fuse). " +
	"A daemon that has served earlier runs makes fewer (it keeps extents and tables it has read). " +
	"strace stops the daemon at every system call, so that run is several times slower than the timed ones and is not timed. " +
	"qcowfs's only ioctl on an image is FIEMAP; read calls are pread64 + read + preadv + preadv2 (splice is not counted)."

// markdownSyscalls renders a workload's syscall counts, if it has any.
func (b *bench) markdownSyscalls(res *wlResult) string {
	p := res.w.syscalls
	if p == nil {
		return ""
	}
	var sb strings.Builder
	if p.kind == perCompressedCluster {
		sb.WriteString("#### Host read calls per compressed cluster, one more cold read under strace (untimed)\n\n")
	} else {
		sb.WriteString("#### Host lseek and FIEMAP calls per copy, one more copy under strace (untimed)\n\n")
	}
	if res.syscallsNote != "" {
		fmt.Fprintf(&sb, "%s.\n\n", res.syscallsNote)
		return sb.String()
	}
	if len(res.syscalls) == 0 {
		sb.WriteString("No traced daemon completed the timed runs.\n\n")
		return sb.String()
	}
	if p.kind == perCompressedCluster {
		sb.WriteString("| contestant | read calls on the image | compressed clusters | read calls per compressed cluster (target < 0.1) | lseek | ioctl | traced read took |\n")
		sb.WriteString("| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n")
	} else {
		sb.WriteString("| contestant | lseek | ioctl (FIEMAP) | read calls on the image | traced copy took |\n")
		sb.WriteString("| --- | ---: | ---: | ---: | ---: |\n")
	}
	for _, sc := range res.syscalls {
		label := contestantByID(sc.Contestant).label
		switch {
		case sc.Error != "":
			cols := 4
			if p.kind == perCompressedCluster {
				cols = 6
			}
			fmt.Fprintf(&sb, "| %s | %s%s |\n", label, escapeCell(sc.Error), strings.Repeat(" | —", cols-1))
		case p.kind == perCompressedCluster:
			fmt.Fprintf(&sb, "| %s | %d | %d | **%.3f** | %d | %d | %.1f s |\n", label, sc.Reads, sc.CompressedClusters, sc.ReadsPerCluster, sc.Lseek, sc.Ioctl, sc.Seconds)
		default:
			fmt.Fprintf(&sb, "| %s | %d | %d | %d | %.1f s |\n", label, sc.Lseek, sc.Ioctl, sc.Reads, sc.Seconds)
		}
	}
	sb.WriteString("\n" + syscallNote + "\n\n")
	return sb.String()
}

// markdownSyscallSummary is one line per workload with syscall counts:
// the counts issues 4 and 5 ask for, per traced daemon.
func (b *bench) markdownSyscallSummary() string {
	var rows []string
	for _, res := range b.results {
		if res.w.syscalls == nil || len(res.syscalls) == 0 {
			continue
		}
		cells := make([]string, len(tracedDaemons))
		for i, id := range tracedDaemons {
			cells[i] = "—"
			for _, sc := range res.syscalls {
				switch {
				case sc.Contestant != id:
				case sc.Error != "":
					cells[i] = "failed"
				case res.w.syscalls.kind == perCompressedCluster:
					cells[i] = fmt.Sprintf("%.3f read calls per compressed cluster", sc.ReadsPerCluster)
				default:
					cells[i] = fmt.Sprintf("%d lseek, %d FIEMAP", sc.Lseek, sc.Ioctl)
					if id != "qcowfs" {
						cells[i] = fmt.Sprintf("%d lseek, %d ioctl", sc.Lseek, sc.Ioctl)
					}
				}
			}
		}
		rows = append(rows, fmt.Sprintf("| %s | %s |", escapeCell(res.w.metrics[0].short), strings.Join(cells, " | ")))
	}
	if len(rows) == 0 {
		return ""
	}
	var sb strings.Builder
	sb.WriteString("| workload (host calls on the image, untimed strace run) |")
	for _, id := range tracedDaemons {
		sb.WriteString(" " + contestantByID(id).label + " |")
	}
	sb.WriteString("\n| --- |" + strings.Repeat(" ---: |", len(tracedDaemons)) + "\n")
	sb.WriteString(strings.Join(rows, "\n") + "\n")
	sb.WriteString("\nPer copy: the host lseek calls and FIEMAP ioctls the daemon made on the image file for one `cp --sparse=always` (issue 4); " +
		"per compressed cluster: the host read calls for one cold `dd` of the whole compressed image, divided by its compressed clusters (issue 5, target below 0.1). " +
		"Counted with strace attached to the daemon in one extra run after the timed ones; strace slows the daemon, so that run is not timed.\n")
	return sb.String()
}
