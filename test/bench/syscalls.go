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
// timed runs, its command runs once more per traced daemon, on a fresh
// mount whose daemon starts under strace:
//
//	strace -D -f --seccomp-bpf -ttt -qq -e signal=none -o OUT -P IMG -e trace=lseek,ioctl,pread64,read,preadv,preadv2 -- DAEMON ARGS
//
// --seccomp-bpf has the kernel stop the daemon only at the traced calls,
// not at every system call as ptrace alone does (a qcowfs cold read of the
// zstd image took 17 s under `strace -f -p`, 5 s this way, 4.7 s untraced).
// That needs the daemon started by strace, not attached to: -D makes
// strace a detached grandchild, so that the daemon is still the process
// the bench starts (qemu-storage-daemon) or that daemonizes itself
// (qcowfs mount). -f follows its threads (Go's, qemu's thread pool). -P IMG
// keeps only the calls on the image file: a FUSE daemon read(2)s every
// request from /dev/fuse, and those would swamp the count. The calls are
// counted from the -ttt timestamps between the start and the end of the
// command, not from the mount's own reads of the header and tables.
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
// 2026-12-02, docs/benchmarks.md), and its traced dd took 33 to 35 s
// (under `strace -f -p`, which stopped it at every call).
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

// traceOnce exposes w's image through c afresh, with the daemon under
// strace, runs the pass's command once, tears the mount down and counts
// the calls the command caused.
func (b *bench) traceOnce(w *workload, c *contestant, clusters int64) syscallCount {
	sc := syscallCount{Workload: w.id, Contestant: c.id, CompressedClusters: clusters}
	im := imageByName(w.image)
	img, err := filepath.EvalSymlinks(filepath.Join(b.imageRoot(w), "img", w.image, w.image+".qcow2"))
	if err != nil {
		sc.Error = err.Error()
		return sc
	}
	dir := filepath.Join(b.cfg.work, "strace")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		sc.Error = err.Error()
		return sc
	}
	out := filepath.Join(dir, w.id+"-"+c.id+".txt")
	os.Remove(out)
	b.underStrace = straceCommand(out, img)
	e, err := c.expose(b, im, b.imageRoot(w))
	b.underStrace = nil
	if err != nil {
		sc.Error = "mounting: " + err.Error()
		return sc
	}
	e.c = c
	undone := false
	down := func() {
		if !undone {
			undone = true
			for j := len(e.undos) - 1; j >= 0; j-- {
				b.undo(e.undos[j])
			}
		}
	}
	defer down()
	tracer := findDaemon("strace", out)
	if tracer == 0 {
		sc.Error = "strace is not running under the daemon"
		return sc
	}
	if err := b.checkExposed(e, mustSize(b, im)); err != nil {
		sc.Error = err.Error()
		return sc
	}
	from := time.Now()
	samples, merr := w.syscalls.measure(b, w, c, e, 0)
	to := time.Now()
	if len(samples) > 0 {
		sc.Seconds = samples[len(samples)-1].seconds
	}
	if merr != nil {
		sc.Error = "the traced run failed: " + merr.Error()
		return sc
	}
	// The daemon exits with its mount, and strace with the daemon,
	// writing out the last of its lines.
	down()
	if !waitGone(tracer, 30*time.Second) {
		syscall.Kill(tracer, syscall.SIGKILL)
		sc.Error = fmt.Sprintf("strace %d still running 30 s after its daemon's unmount; killed", tracer)
		return sc
	}
	data, err := os.ReadFile(out)
	if err != nil {
		sc.Error = "strace wrote nothing: " + err.Error()
		return sc
	}
	calls, err := countStraceCalls(string(data), from, to)
	if err != nil {
		sc.Error = err.Error()
		return sc
	}
	os.Remove(out)
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

// straceCommand is the command line a traced daemon starts under: one
// line per tracedSyscalls call on img, with its time, in out.
func straceCommand(out, img string) []string {
	return []string{"strace", "-D", "-f", "--seccomp-bpf", "-ttt", "-qq", "-e", "signal=none", "-o", out, "-P", img,
		"-e", "trace=" + strings.Join(tracedSyscalls, ","), "--"}
}

// daemonCommand is the daemon command name args as the bench starts it:
// under b.underStrace during a syscall pass, as it is otherwise.
func (b *bench) daemonCommand(name string, args []string) (string, []string) {
	if len(b.underStrace) == 0 {
		return name, args
	}
	return b.underStrace[0], append(append(slices.Clone(b.underStrace[1:]), name), args...)
}

// countStraceCalls counts, per system call, the calls in strace's -f -ttt
// output that started between from and to. A line is a call, or the end
// of one that another thread's line cut in two, which is not counted
// again:
//
//	12847 1796229136.740606 ioctl(3, FS_IOC_FIEMAP, {...}) = 0
//	12850 1796229136.740651 pread64(3,  <unfinished ...>
//	12850 1796229136.740702 <... pread64 resumed>"..."..., 65536, 196608) = 65536
func countStraceCalls(text string, from, to time.Time) (map[string]int64, error) {
	lo, hi := float64(from.UnixNano())/1e9, float64(to.UnixNano())/1e9
	calls := map[string]int64{}
	for _, line := range strings.Split(text, "\n") {
		f := strings.SplitN(line, " ", 3)
		if len(f) < 3 {
			if strings.TrimSpace(line) != "" {
				return nil, fmt.Errorf("strace output: unexpected line %q", line)
			}
			continue
		}
		if strings.HasPrefix(f[2], "<...") {
			continue
		}
		name, _, ok := strings.Cut(f[2], "(")
		ts, err := strconv.ParseFloat(f[1], 64)
		if !ok || err != nil || !slices.Contains(tracedSyscalls, name) {
			return nil, fmt.Errorf("strace output: unexpected line %q", line)
		}
		if ts >= lo && ts <= hi {
			calls[name]++
		}
	}
	return calls, nil
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
var syscallNote = "Counted by `strace -D -f --seccomp-bpf -ttt -P IMG -e trace=" + strings.Join(tracedSyscalls, ",") + "`, " +
	"under which the daemon of a fresh mount starts, for one more run of the workload's command after the timed runs (caches dropped first, as before every timed run): " +
	"the calls of a first copy or read after mounting (from the command's start to its end, not the mount's own reads), on the image file only (not the daemon's reads of /dev/fuse). " +
	"A daemon that has served earlier runs makes fewer (it keeps extents and tables it has read). " +
	"strace stops the daemon at every traced call, so that run is slower than the timed ones and is not timed. " +
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
		"Counted with strace, under which the daemon of a fresh mount starts, in one extra run after the timed ones; strace slows the daemon, so that run is not timed.\n")
	return sb.String()
}
