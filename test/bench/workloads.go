package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// A unit says what a metric's numbers are and which way is better.
type unit int

const (
	mbps    unit = iota // MB/s (10^6 bytes per second), higher is better
	iops                // operations per second, higher is better
	seconds             // wall time, lower is better
	millis              // a latency in milliseconds, lower is better
	micros              // microseconds (CPU time per I/O), lower is better
	factor              // a ratio of bytes (host bytes per guest byte), lower is better
)

func (u unit) String() string {
	return [...]string{"MB/s", "IOPS", "s", "ms", "µs", "x"}[u]
}

// lowerBetter says which way is better in u.
func (u unit) lowerBetter() bool { return u != mbps && u != iops }

// A metric is one number a workload measures per run and contestant; each
// metric gets its own table.
type metric struct {
	id    string
	title string // the table's heading
	short string // its line in the summary
	unit  unit
	// detail keeps the metric out of the summary (its table stays).
	detail bool
	// unsettled: a peer's stop (settle, run.go) does not look at this
	// metric: a worst latency is one request's, and host bytes per
	// guest byte are read against the guest's bytes, not against qcowfs.
	unsettled bool
}

// A workload is one thing done to one image by every contestant in turn.
type workload struct {
	id    string
	title string
	image string
	// tmpfs: the image files (qcow2 and raw twin) are read from copies
	// on a tmpfs. outTmpfs: copies are written to the tmpfs (the image
	// stays where it is unless tmpfs is set too).
	tmpfs, outTmpfs bool
	who             []string // contestant ids, in the order of each run
	metrics         []metric
	// timeout bounds one measurement; 0 is the bench's default. A
	// contestant that times out is not run again in this workload.
	timeout time.Duration
	// na gives, per contestant, the reason it is expected to be unable
	// to take part: if exposing fails, the table says "n/a: reason".
	na map[string]string
	// skipIfTimedOut names a workload whose timeouts carry over: a peer
	// that timed out there is not run here. The baselines run anyway
	// (qemu-img convert of a URL stalls on the 2 GiB copy over
	// loopback, and not on the sparse one).
	skipIfTimedOut string
	// prepare runs once per exposure before the runs (attaching a loop
	// device); measure runs once per run.
	prepare func(b *bench, w *workload, e *exposure) error
	measure func(b *bench, w *workload, c *contestant, e *exposure, run int) ([]sample, error)
	// skipWarmWhenUncached lists contestants whose warm read is skipped
	// when their cold read left none of the file in the page cache: their
	// daemon has the cache dropped at open, so a warm read would be one
	// more cold read through the daemon (see measureDDColdWarm).
	skipWarmWhenUncached []string
	// syscalls, when set, adds one untimed run after the timed ones that
	// counts the daemons' system calls on the image file (syscalls.go).
	syscalls *syscallPass
	// write, when set, makes this a write workload (writes.go): every
	// contestant writes into a fresh image of its own instead of
	// reading a cached one, which is checked after every run.
	write *writeSpec
	// remote, when set, makes the image be read over HTTP (remote.go):
	// imageRoot is then a URL.
	remote *remoteSpec
	// freshExposure: every run gets a new mount (a daemon's own cache
	// must not serve the next run).
	freshExposure bool
	// runs overrides the bench's runs per contestant (0: the bench's);
	// --runs on the command line wins.
	runs int
	// what describes the method for the report.
	what string
}

// A sample is one measurement: the wall time and what was moved.
type sample struct {
	metric   string
	seconds  float64
	bytes    int64   // bytes read or copied, for MB/s
	ops      float64 // IOPS, for fio
	timedOut bool
	stalled  bool   // the timeout was a stall's (stalled.go)
	note     string // something checked once (output size, bytes equal)
	// cached is the part of the file the page cache held before a warm
	// read (0 to 1), when hasCached.
	cached    float64
	hasCached bool
	// skipped says why this metric was not measured in this run (the
	// run's other metrics were); such a sample is no measurement.
	skipped string
	// rss is the peak RSS of the measured command itself (check.go),
	// for contestants that are commands, not daemons.
	rss int64
	// v is the value of a sample in millis, micros or factor.
	v float64
}

// value is the sample in its metric's unit.
func (s sample) value(u unit) float64 {
	switch u {
	case mbps:
		return float64(s.bytes) / s.seconds / 1e6
	case iops:
		return s.ops
	case millis, micros, factor:
		return s.v
	}
	return s.seconds
}

// errTimedOut marks a measurement that hit its workload's timeout.
var errTimedOut = errors.New("timed out")

// cutOff says how a run that did not finish (s, timed out) was cut off.
func (b *bench) cutOff(w *workload, s sample) string {
	if s.stalled {
		return fmt.Sprintf("stalled (no I/O for %.0f s; cut off after %.0f s)", stallOf(w).Seconds(), s.seconds)
	}
	return fmt.Sprintf("timed out (> %v)", b.timeoutOf(w).Round(time.Second))
}

// timeoutOf is the per-measurement timeout of w.
func (b *bench) timeoutOf(w *workload) time.Duration {
	if w.timeout > 0 {
		return w.timeout
	}
	return b.cfg.timeout
}

// size is the virtual size of an image: its raw twin's size.
func (b *bench) size(im *image) (int64, error) {
	st, err := os.Stat(b.rawPath(im.raw))
	if err != nil {
		return 0, err
	}
	return st.Size(), nil
}

var ddBytes = regexp.MustCompile(`(?m)^(\d+) bytes`)

// ddRead reads the exposed file with dd bs=1M and returns the sample.
func (b *bench) ddRead(w *workload, e *exposure, metricID string) (sample, error) {
	im := imageByName(w.image)
	want, err := b.size(im)
	if err != nil {
		return sample{}, err
	}
	r := b.run(&cmd{name: "dd", args: []string{"if=" + e.file, "of=/dev/null", "bs=1M"},
		timeout: b.timeoutOf(w), stall: stallOf(w), stuck: b.abortExposure(e)})
	s, err := r.sample(metricID)
	if err != nil {
		return s, err
	}
	m := ddBytes.FindStringSubmatch(r.stderr)
	if m == nil {
		return s, fmt.Errorf("dd: no byte count in %q", lastLines(r.stderr, 2))
	}
	s.bytes, _ = strconv.ParseInt(m[1], 10, 64)
	if s.bytes != want {
		return s, fmt.Errorf("dd read %d bytes, want %d", s.bytes, want)
	}
	return s, nil
}

// measureDDColdWarm drops the caches, reads the file (cold), then reads it
// again (warm: the file was read once before).
func measureDDColdWarm(b *bench, w *workload, c *contestant, e *exposure, run int) ([]sample, error) {
	if err := b.dropCachesIfAllowed(); err != nil {
		return nil, err
	}
	cold, err := b.ddRead(w, e, "cold")
	if err != nil {
		return []sample{cold}, err
	}
	cached := b.cachedFraction(e)
	if cached >= 0 && cached < 0.01 && slices.Contains(w.skipWarmWhenUncached, c.id) {
		return []sample{cold, {metric: "warm", skipped: fmt.Sprintf("skipped: %.0f%% of the file in the page cache after the cold read "+
			"(it is dropped at open), so a warm read would be one more read through the daemon, like the cold one", 100*cached)}}, nil
	}
	warm, err := b.ddRead(w, e, "warm")
	warm.cached, warm.hasCached = cached, cached >= 0
	return []sample{cold, warm}, err
}

// cachedFraction is the part of the exposed file the page cache holds, as
// fincore sees it, or -1. fincore opens the file, as the warm read will:
// a daemon that has the kernel drop the cache at open (no
// FOPEN_KEEP_CACHE) shows 0 here.
func (b *bench) cachedFraction(e *exposure) float64 {
	out, err := b.must(&cmd{name: "fincore", args: []string{"-b", "-n", "-r", "-o", "RES,SIZE", e.file},
		timeout: 30 * time.Second, stuck: b.abortExposure(e)})
	if err != nil {
		return -1
	}
	f := strings.Fields(out)
	if len(f) != 2 {
		return -1
	}
	res, err1 := strconv.ParseInt(f[0], 10, 64)
	size, err2 := strconv.ParseInt(f[1], 10, 64)
	if err1 != nil || err2 != nil || size <= 0 {
		return -1
	}
	return float64(res) / float64(size)
}

// measureDDCold drops the caches and reads the file once.
func measureDDCold(b *bench, w *workload, c *contestant, e *exposure, run int) ([]sample, error) {
	if err := b.dropCachesIfAllowed(); err != nil {
		return nil, err
	}
	s, err := b.ddRead(w, e, "cold")
	return []sample{s}, err
}

// dropCachesIfAllowed drops the caches when this machine lets us, and
// otherwise only writes back dirty data (the report says which).
func (b *bench) dropCachesIfAllowed() error {
	if !b.canDrop {
		b.run(&cmd{name: "sync"})
		return nil
	}
	if err := dropCaches(); err != nil {
		return fmt.Errorf("dropping caches: %w", err)
	}
	return nil
}

// fioArgs are the arguments of fio's 4 KiB random read: psync, 4 jobs, O_DIRECT, for a fixed time.
func (b *bench) fioArgs(file string) []string {
	return []string{"--name=randread", "--filename=" + file, "--readonly", "--rw=randread", "--bs=4k",
		"--ioengine=psync", "--direct=1", "--numjobs=4", "--group_reporting", "--time_based",
		fmt.Sprintf("--runtime=%ds", int(b.cfg.fioTime.Seconds())), "--randrepeat=0", "--norandommap",
		"--output-format=json"}
}

func measureFio(b *bench, w *workload, c *contestant, e *exposure, run int) ([]sample, error) {
	// fio runs for --fio-time once its jobs have opened the file, and
	// needs a moment to start and end: a minute more, or the workload's
	// own cutoff for slow readers more.
	slack := time.Minute
	if w.timeout > 0 {
		slack = w.timeout
	}
	r := b.run(&cmd{name: "fio", args: b.fioArgs(e.file), timeout: b.cfg.fioTime + slack, stall: stallOf(w), stuck: b.abortExposure(e)})
	s, err := r.sample("iops")
	if err != nil {
		return []sample{s}, err
	}
	var out struct {
		Jobs []struct {
			Error int `json:"error"`
			Read  struct {
				IOPS    float64 `json:"iops"`
				IOBytes int64   `json:"io_bytes"`
			} `json:"read"`
		} `json:"jobs"`
	}
	js := r.stdout
	if i := strings.IndexByte(js, '{'); i > 0 {
		js = js[i:] // fio may print notes before the JSON
	}
	if err := json.Unmarshal([]byte(js), &out); err != nil {
		return []sample{s}, fmt.Errorf("fio output: %v", err)
	}
	if len(out.Jobs) != 1 {
		return []sample{s}, fmt.Errorf("fio reported %d job groups, want 1", len(out.Jobs))
	}
	if out.Jobs[0].Error != 0 {
		return []sample{s}, fmt.Errorf("fio: error %d (%s)", out.Jobs[0].Error, lastLines(r.stderr, 2))
	}
	s.ops, s.bytes = out.Jobs[0].Read.IOPS, out.Jobs[0].Read.IOBytes
	if s.ops <= 0 {
		return []sample{s}, fmt.Errorf("fio: no reads completed (%s)", lastLines(r.stderr, 2))
	}
	return []sample{s}, nil
}

// measureCopy copies the exposed file with cp --sparse=always (or, for
// qemu-img convert, converts the image) after dropping the caches; the
// first run of each contestant also records the output's allocated size
// and checks its bytes against the image's raw twin.
func measureCopy(b *bench, w *workload, c *contestant, e *exposure, run int) ([]sample, error) {
	im := imageByName(w.image)
	outDir := filepath.Join(b.cfg.work, "out")
	if w.outTmpfs || w.tmpfs {
		outDir = filepath.Join(b.tmpfsDir(), "out")
	}
	if err := os.MkdirAll(outDir, 0o755); err != nil {
		return nil, err
	}
	out := filepath.Join(outDir, "copy.raw")
	os.Remove(out)
	defer os.Remove(out)
	if err := b.dropCachesIfAllowed(); err != nil {
		return nil, err
	}
	var c1 *cmd
	if c.id == "convert" {
		c1 = &cmd{name: "qemu-img", args: []string{"convert", "-O", "raw", filepath.Join(b.imageRoot(w), "img", im.name, im.name+".qcow2"), out}}
	} else {
		c1 = &cmd{name: "cp", args: []string{"--sparse=always", e.file, out}, stuck: b.abortExposure(e)}
	}
	c1.timeout = b.timeoutOf(w)
	r := b.run(c1)
	s, err := r.sample("time")
	if err != nil {
		return []sample{s}, err
	}
	if run == 1 {
		alloc, err := allocated(out)
		if err != nil {
			return []sample{s}, err
		}
		s.note = fmt.Sprintf("du %s", humanBytes(alloc))
		// The baselines' outputs are the raw twin by construction (the
		// raw row copies the twin; qemu-img made the twin and the
		// image): comparing them would only cost a read of both. A peer
		// is checked once per image: the tmpfs variant reads the same
		// bytes with the same code. qcowfs is checked every time: it
		// finds the host extents with FIEMAP on ext4 and with lseek on
		// a tmpfs, which has no FIEMAP.
		key := c.id + " " + im.name
		if c.role == baseline {
			return []sample{s}, nil
		}
		if c.role == peer && b.verified[key] != "" {
			s.note += ", bytes checked in " + b.verified[key]
			return []sample{s}, nil
		}
		same, err := sameBytes(out, b.rawPath(im.raw))
		if err != nil {
			return []sample{s}, fmt.Errorf("comparing the copy with the raw twin: %w", err)
		}
		if !same.equal {
			return []sample{s}, fmt.Errorf("the copy differs from `qemu-img convert -O raw`: %s", same.why)
		}
		s.note = fmt.Sprintf("du %s, bytes = qemu-img's", humanBytes(alloc))
		b.verified[key] = w.id
	}
	return []sample{s}, nil
}

// prepareGuest attaches the exposed disk to a read-only loop device, adds
// its partition with partx (this kernel parses no partition tables) and
// mounts the ext4 file system in it read-only.
func prepareGuest(b *bench, w *workload, e *exposure) error {
	out, err := b.must(&cmd{name: "losetup", args: []string{"-r", "-f", "--show", e.file}, timeout: time.Minute, stuck: b.abortExposure(e)})
	if err != nil {
		return err
	}
	dev := strings.TrimSpace(out)
	if !strings.HasPrefix(dev, "/dev/loop") {
		return fmt.Errorf("losetup attached %s to %q", e.file, dev)
	}
	e.undos = append(e.undos, b.push("detach "+dev, func() error {
		_, err := b.must(&cmd{name: "losetup", args: []string{"-d", dev}, timeout: time.Minute, cleanup: true})
		return err
	}))
	name := filepath.Base(dev) + "p1"
	sys := filepath.Join("/sys/block", filepath.Base(dev), name)
	if !exists(sys) {
		e.undos = append(e.undos, b.push("partx -d "+dev, func() error {
			if !exists(sys) {
				return nil
			}
			_, err := b.must(&cmd{name: "partx", args: []string{"-d", dev}, timeout: time.Minute, cleanup: true})
			return err
		}))
		if _, err := b.must(&cmd{name: "partx", args: []string{"-a", dev}, timeout: time.Minute, stuck: b.abortExposure(e)}); err != nil {
			return err
		}
	}
	node := filepath.Join("/dev", name)
	if !b.waitUntil(b.ctx, 10*time.Second, func() bool { return exists(node) }) {
		return fmt.Errorf("%s did not appear", node)
	}
	if start, _ := os.ReadFile(filepath.Join(sys, "start")); strings.TrimSpace(string(start)) != strconv.Itoa(guestPartStart/512) {
		return fmt.Errorf("%s starts at sector %q, want %d", node, strings.TrimSpace(string(start)), guestPartStart/512)
	}
	dir, err := b.mountDir(e.c.id+"-guest", false)
	if err != nil {
		return err
	}
	if _, err := b.must(&cmd{name: "mount", args: []string{"-t", "ext4", "-o", "ro,noload", node, dir}, timeout: time.Minute, stuck: b.abortExposure(e)}); err != nil {
		os.Remove(dir)
		return err
	}
	e.undos = append(e.undos, b.push("unmount "+dir, func() error {
		_, err := b.must(&cmd{name: "umount", args: []string{dir}, timeout: time.Minute, cleanup: true})
		if err != nil && isMounted(dir) {
			syscall.Unmount(dir, syscall.MNT_DETACH)
		}
		if isMounted(dir) {
			return fmt.Errorf("%s: still mounted", dir)
		}
		os.Remove(dir)
		return nil
	}))
	e.guest = dir
	return nil
}

// measureGuest drops the caches and reads every file of the guest file
// system with tar, counting the archive's bytes.
func measureGuest(b *bench, w *workload, c *contestant, e *exposure, run int) ([]sample, error) {
	if err := b.dropCachesIfAllowed(); err != nil {
		return nil, err
	}
	r := b.run(&cmd{name: "bash", args: []string{"-c", "set -o pipefail; tar cf - . | wc -c"}, dir: e.guest,
		timeout: b.timeoutOf(w), stall: stallOf(w), stuck: b.abortExposure(e)})
	s, err := r.sample("time")
	if err != nil {
		return []sample{s}, err
	}
	n, err := strconv.ParseInt(strings.TrimSpace(r.stdout), 10, 64)
	if err != nil {
		return []sample{s}, fmt.Errorf("tar | wc -c printed %q", r.stdout)
	}
	s.bytes = n
	if run == 1 {
		s.note = fmt.Sprintf("tar: %s", humanBytes(n))
	}
	return []sample{s}, nil
}
