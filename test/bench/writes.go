package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// The write workloads (issue 15's first measurement, issue 16's benchmark
// section): qcowfs's writable mount against qemu's writable FUSE export,
// with the raw file (the ceiling) and, for the copy-on-write pattern,
// qemu-img bench (qemu's own write path without FUSE) as baselines.
//
// Unlike a read workload, each contestant writes into an image of its
// own, made fresh by qemu-img create: an empty one for every run, or a
// fully allocated one (preallocation=full) made once and overwritten by
// every run. After every run the daemon is stopped (which closes the
// image) and the image is checked with qemu, the oracle: `qemu-img check`
// must find no corruption and no leak. After each contestant's first run,
// what was written must also read back through qemu (fio's own
// verification of its checksummed blocks, `qemu-img compare`, or e2fsck
// and a tar diff of the guest file system). A run whose image fails a
// check is a failure, not a number. The data is read back once, not every
// run: reading a written 8 GiB image back through qemu took 10 to 20 s a
// run here, a fifth of the write workloads' time, and the crash suite of
// `make test` checks qcowfs's data far harder.

// A writeSpec is what makes a workload a write workload.
type writeSpec struct {
	size int64 // virtual size of the fresh image
	// full: fully allocated (preallocation=full: every cluster mapped,
	// zeros written), made once per contestant and overwritten by each
	// of its runs; otherwise empty and made fresh for every run.
	full  bool
	uses  []string // cached images the workload reads (the plain image's raw twin)
	image string   // what the report says of the image written
	// fio is the fio job (without the file and the options of one
	// run) for the workloads that run fio: the timed run and the
	// verification replay the same job.
	fio []string
	// timed: fio runs for --fio-time; otherwise to the end of the job.
	timed bool
	// prepare runs once before the runs (caching the data written).
	prepare func(b *bench, w *workload) error
	// verify checks the data of a closed image (nil: qemu-img check
	// only); it returns a note for the report.
	verify func(b *bench, w *workload, t *target) (string, error)
}

// A target is the fresh image one contestant writes in a write workload.
type target struct {
	dir  string // WORK/w/WORKLOAD-CONTESTANT: img/ and fio's state/
	img  string // the qcow2 image, or for the raw baseline the raw file
	name string // the image's stem: qcowfs shows img/NAME.qcow2 as NAME.raw
	raw  bool
	size int64
	// wrote is what the last run wrote, in I/Os (fio's total_ios): the
	// verification must read back as many blocks.
	wrote int64
	// allocBefore is the image file's allocated size before fstrim
	// (the guest workload).
	allocBefore int64
}

func (t *target) stateDir() string { return filepath.Join(t.dir, "state") }

// freshTarget makes a new image for contestant c in w, replacing the one
// of an earlier run.
func (b *bench) freshTarget(w *workload, c *contestant) (*target, error) {
	dir := filepath.Join(b.cfg.work, "w", w.id+"-"+c.id)
	if err := os.RemoveAll(dir); err != nil {
		return nil, err
	}
	for _, d := range []string{"img", "state"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return nil, err
		}
	}
	t := &target{dir: dir, name: "disk", raw: c.id == "raw", size: w.write.size}
	format := "qcow2"
	if t.raw {
		format = "raw"
	}
	t.img = filepath.Join(dir, "img", t.name+"."+format)
	args := []string{"create", "-q", "-f", format}
	if w.write.full {
		args = append(args, "-o", "preallocation=full")
	}
	if _, err := b.must(&cmd{name: "qemu-img", args: append(args, t.img, strconv.FormatInt(t.size, 10)), timeout: 5 * time.Minute}); err != nil {
		return nil, err
	}
	// The previous run's image was just deleted, and the run before
	// may have left writeback: the disk settles before this run starts,
	// not during it.
	if _, err := b.must(&cmd{name: "sync", timeout: 5 * time.Minute}); err != nil {
		return nil, err
	}
	return t, nil
}

// runWriteWorkload runs a write workload: for every run, every contestant
// in turn exposes its own image, writes, closes it, and has it checked.
func (b *bench) runWriteWorkload(w *workload) *wlResult {
	res := newResult(w)
	start := time.Now()
	res.load = load1()
	defer func() { res.elapsed = time.Since(start) }()
	runs := b.runsOf(w)
	b.say("== %s: %s (%d runs)", w.id, w.title, runs)
	for _, id := range w.who {
		if c := contestantByID(id); !b.haveTool(c) {
			res.fail(id, fmt.Sprintf("n/a: %s is not installed (package %s)", c.tool, c.pkg))
		}
	}
	if w.write.prepare != nil {
		if err := w.write.prepare(b, w); err != nil {
			for _, id := range w.who {
				res.fail(id, "failed: "+err.Error())
			}
			return res
		}
	}
	targets := map[string]*target{}
	defer func() {
		for _, t := range targets {
			os.RemoveAll(t.dir)
		}
	}()
	for run := 1; run <= runs; run++ {
		for _, id := range w.who {
			if res.status[id] != "" || res.settled[id] {
				continue
			}
			if b.ctx.Err() != nil {
				return res
			}
			c := contestantByID(id)
			if res.settleNow(w, c, run, runs) {
				continue
			}
			samples, err := b.writeRun(w, c, targets, run, res)
			if b.ctx.Err() != nil {
				return res
			}
			// A run whose image fails its check measured nothing.
			for _, s := range samples {
				res.add(w, id, run, s, err != nil, err)
			}
			switch {
			case errors.Is(err, errTimedOut):
				res.fail(id, fmt.Sprintf("timed out in run %d; not run again", run))
			case err != nil:
				res.fail(id, fmt.Sprintf("failed in run %d: %v", run, err))
			}
			if err != nil {
				fmt.Printf("   %-24s run %d: %v\n", c.label, run, err)
			} else {
				fmt.Printf("   %-24s run %d: %s\n", c.label, run, describeSamples(w, samples))
			}
		}
	}
	return res
}

// writeRun is one run of one contestant: a fresh image (or the allocated
// one of its first run), exposed, written, closed and checked.
func (b *bench) writeRun(w *workload, c *contestant, targets map[string]*target, run int, res *wlResult) ([]sample, error) {
	t := targets[c.id]
	if t == nil || !w.write.full {
		var err error
		if t, err = b.freshTarget(w, c); err != nil {
			return nil, fmt.Errorf("making the image: %w", err)
		}
		targets[c.id] = t
	}
	e := &exposure{}
	if c.exposeW != nil {
		var err error
		if e, err = c.exposeW(b, t); err != nil {
			return nil, err
		}
	}
	e.c, e.t = c, t
	closed := false
	closeImage := func() error {
		if closed {
			return nil
		}
		closed = true
		b.abortHung(e)
		var errs []error
		for j := len(e.undos) - 1; j >= 0; j-- {
			if err := b.undo(e.undos[j]); err != nil {
				errs = append(errs, err)
			}
		}
		return errors.Join(errs...)
	}
	defer closeImage()
	if e.file != "" {
		if err := b.checkExposed(e, t.size); err != nil {
			return nil, err
		}
	}
	samples, err := w.measure(b, w, c, e, run)
	if n := e.peak(); n > 0 {
		res.rss[c.id] = max(res.rss[c.id], n)
	}
	if e.hung {
		return samples, err
	}
	if cerr := closeImage(); cerr != nil && err == nil {
		err = fmt.Errorf("closing the image: %w", cerr)
	}
	if err != nil {
		return samples, err
	}
	var notes []string
	if !t.raw {
		note, err := b.qemuImgCheck(t.img)
		if err != nil {
			return samples, err
		}
		notes = append(notes, note)
	}
	// The data is read back after the first run only (the comment at the
	// top of this file says why).
	if w.write.verify != nil && run == 1 {
		note, err := w.write.verify(b, w, t)
		if err != nil {
			return samples, fmt.Errorf("data check: %w", err)
		}
		notes = append(notes, note)
	}
	if run == 1 && len(samples) > 0 && len(notes) > 0 {
		if samples[0].note != "" {
			notes = append([]string{samples[0].note}, notes...)
		}
		samples[0].note = strings.Join(notes, "; ")
	}
	return samples, nil
}

// qemuImgCheck runs qemu-img check on a closed image: anything but a
// clean image (corruption, and also leaks: every daemon here closes its
// image cleanly) fails the run.
func (b *bench) qemuImgCheck(img string) (string, error) {
	r := b.run(&cmd{name: "qemu-img", args: []string{"check", img}, timeout: 5 * time.Minute})
	if r.exitCode != 0 {
		why := checkExits[r.exitCode]
		if why == "" {
			why = "unexpected exit status"
		}
		return "", fmt.Errorf("qemu-img check: exit status %d (%s): %s", r.exitCode, why, lastLines(r.stdout+"\n"+r.stderr, 3))
	}
	return "qemu-img check clean", nil
}

// qemuRaw converts a closed image to a raw file next to it with qemu-img
// (qemu reads what was written) and returns its path, or the raw
// baseline's own file.
func (b *bench) qemuRaw(t *target) (string, func(), error) {
	if t.raw {
		return t.img, func() {}, nil
	}
	dir, err := b.ensureCheckTmpfs()
	if err != nil {
		return "", nil, err
	}
	out := filepath.Join(dir, "check.raw")
	os.Remove(out)
	if _, err := b.must(&cmd{name: "qemu-img", args: []string{"convert", "-q", "-f", "qcow2", "-O", "raw", t.img, out}, timeout: 5 * time.Minute}); err != nil {
		return "", nil, err
	}
	return out, func() { os.Remove(out) }, nil
}

// checkTmpfsDir holds the raw files qemu-img convert makes of the closed
// images: on a tmpfs, so that a check costs no disk writes (the images
// are sparse: at most the 2 GiB of the sequential write are data).
func (b *bench) checkTmpfsDir() string { return filepath.Join(b.cfg.work, "wcheck") }

func (b *bench) ensureCheckTmpfs() (string, error) {
	dir := b.checkTmpfsDir()
	if isMounted(dir) {
		return dir, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	if _, err := b.must(command("mount", "-t", "tmpfs", "-o", "size=4g,mode=0755", "qcowfs-bench-check", dir)); err != nil {
		return "", err
	}
	b.push("unmount the tmpfs "+dir, func() error { return b.forceUnmount(dir) })
	return dir, nil
}

// fioRunArgs are the options of one timed fio run on file: the job,
// verification headers written but not read back (the check does that,
// through qemu, once the image is closed), and fio's state saved so that
// the check replays exactly the blocks written.
func (b *bench) fioRunArgs(w *workload, file string) []string {
	args := append(slices.Clone(w.write.fio), "--filename="+file, "--do_verify=0", "--verify_state_save=1", "--output-format=json")
	if w.write.timed {
		args = append(args, "--time_based", fmt.Sprintf("--runtime=%ds", int(b.cfg.fioTime.Seconds())))
	}
	return args
}

// verifyFio replays w's fio job in verify-only mode over what qemu reads
// from the closed image: every block written must carry its own offset
// and a good checksum, and as many blocks as were written must be read.
func verifyFio(b *bench, w *workload, t *target) (string, error) {
	file, done, err := b.qemuRaw(t)
	if err != nil {
		return "", err
	}
	defer done()
	// Buffered reads: the file was just written (by convert, to a
	// tmpfs), and O_DIRECT would read it from the disk 4 KiB at a time.
	args := append(slices.Clone(w.write.fio), "--filename="+file, "--verify_only", "--verify_state_load=1", "--verify_state_save=0",
		"--direct=0", "--output-format=json")
	r := b.run(&cmd{name: "fio", args: args, dir: t.stateDir(), timeout: 5 * time.Minute})
	if r.err != nil {
		return "", fmt.Errorf("fio --verify_only: %v: %s", r.err, lastLines(r.stdout, 4))
	}
	out, err := parseFio(r.stdout)
	if err != nil {
		return "", err
	}
	if out.Error != 0 {
		return "", fmt.Errorf("fio --verify_only: error %d: %s", out.Error, lastLines(r.stderr, 3))
	}
	if out.Read.TotalIOs != t.wrote {
		return "", fmt.Errorf("fio --verify_only read back %d blocks, %d were written", out.Read.TotalIOs, t.wrote)
	}
	how := "qemu-img convert, then "
	if t.raw {
		how = ""
	}
	return fmt.Sprintf("%sfio --verify_only: all %d blocks read back with their offset and crc32c", how, out.Read.TotalIOs), nil
}

// fioJob is the part of fio's JSON output the bench reads.
type fioJob struct {
	Error int    `json:"error"`
	Write fioDir `json:"write"`
	Read  fioDir `json:"read"`
	Sync  struct {
		TotalIOs int64  `json:"total_ios"`
		Lat      fioLat `json:"lat_ns"`
	} `json:"sync"`
}

type fioDir struct {
	IOPS     float64 `json:"iops"`
	IOBytes  int64   `json:"io_bytes"`
	TotalIOs int64   `json:"total_ios"`
	Clat     fioLat  `json:"clat_ns"`
	Lat      fioLat  `json:"lat_ns"`
}

type fioLat struct {
	Max        float64            `json:"max"`
	Percentile map[string]float64 `json:"percentile"`
}

func parseFio(stdout string) (fioJob, error) {
	var out struct {
		Jobs []fioJob `json:"jobs"`
	}
	js := stdout
	if i := strings.IndexByte(js, '{'); i > 0 {
		js = js[i:] // fio may print notes before the JSON
	}
	if err := json.Unmarshal([]byte(js), &out); err != nil {
		return fioJob{}, fmt.Errorf("fio output: %v", err)
	}
	if len(out.Jobs) != 1 {
		return fioJob{}, fmt.Errorf("fio reported %d job groups, want 1", len(out.Jobs))
	}
	return out.Jobs[0], nil
}

// procCPU is a process's user and system CPU time so far (all its
// threads, living and exited), from /proc/PID/stat in clock ticks of
// 1/100 s (USER_HZ).
func procCPU(pid int) (time.Duration, bool) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, false
	}
	s := string(data)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(s[i+1:])
	// After the name: state (3), ..., utime (14), stime (15).
	if len(f) < 13 {
		return 0, false
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return time.Duration(ut+st) * 10 * time.Millisecond, true
}

// procWriteBytes is what a process (with its exited threads and reaped
// children) has passed to write system calls: wchar of /proc/PID/io.
// Not write_bytes, which counts a page once when it is dirtied: zeros
// written into a page that a write of data dirties again before
// writeback would not show. wchar also counts a daemon's replies to
// /dev/fuse, 24 bytes per write request here, under 0.1% of 64 KiB.
func procWriteBytes(pid int) (int64, bool) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/io", pid))
	if err != nil {
		return 0, false
	}
	return parseWriteBytes(string(data))
}

func parseWriteBytes(io string) (int64, bool) {
	for _, line := range strings.Split(io, "\n") {
		if v, ok := strings.CutPrefix(line, "wchar:"); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return n, err == nil
		}
	}
	return 0, false
}

// ioShell runs a command under sh and prints the shell's /proc/self/io
// after it: a reaped child's I/O counts are added to its parent's, so
// this is what the command (and its children) wrote to storage. The
// marker separates it from the command's output.
const ioMarker = "qcowfs-bench-io:"

func ioShell(name string, args ...string) (string, []string) {
	return "sh", append([]string{"-c", `"$@"; rc=$?; echo ` + ioMarker + `; cat /proc/$$/io; exit $rc`, "sh", name}, args...)
}

// splitIO cuts the io block off a command's stdout.
func splitIO(stdout string) (string, int64, bool) {
	i := strings.LastIndex(stdout, ioMarker)
	if i < 0 {
		return stdout, 0, false
	}
	n, ok := parseWriteBytes(stdout[i+len(ioMarker):])
	return stdout[:i], n, ok
}

// measureFioWrite runs w's fio job on the exposed file and returns the
// samples of the metrics w has: IOPS, MB/s, latencies, the daemon's CPU
// per I/O, and host bytes written per guest byte.
func measureFioWrite(b *bench, w *workload, c *contestant, e *exposure, run int) ([]sample, error) {
	cpu0, okCPU := procCPU(e.pid)
	wb0, okWB := procWriteBytes(e.pid)
	name, args := "fio", b.fioRunArgs(w, e.file)
	if e.pid == 0 {
		name, args = ioShell(name, args...)
	}
	// The state files of the last run go: the check replays this one.
	olds, _ := filepath.Glob(filepath.Join(e.t.stateDir(), "*.state"))
	for _, p := range olds {
		os.Remove(p)
	}
	timeout := 5 * time.Minute
	if w.write.timed {
		timeout = b.cfg.fioTime + 2*time.Minute
	}
	r := b.run(&cmd{name: name, args: args, dir: e.t.stateDir(), timeout: timeout, stuck: b.abortExposure(e)})
	cpu1, okCPU1 := procCPU(e.pid)
	wb1, okWB1 := procWriteBytes(e.pid)
	stdout, shellWB, okShell := splitIO(r.stdout)
	wall := r.elapsed.Seconds()
	if r.timedOut {
		return []sample{{metric: w.metrics[0].id, seconds: wall, timedOut: true}}, fmt.Errorf("%w: %v", errTimedOut, r.err)
	}
	if r.err != nil {
		return nil, r.err
	}
	out, err := parseFio(stdout)
	if err != nil {
		return nil, err
	}
	if out.Error != 0 {
		return nil, fmt.Errorf("fio: error %d (%s)", out.Error, lastLines(r.stderr, 2))
	}
	if out.Write.TotalIOs <= 0 {
		return nil, fmt.Errorf("fio: no writes completed (%s)", lastLines(r.stderr, 2))
	}
	e.t.wrote = out.Write.TotalIOs
	ms := func(ns float64) float64 { return ns / 1e6 }
	var ss []sample
	for _, m := range w.metrics {
		s := sample{metric: m.id, seconds: wall}
		switch m.id {
		case "iops":
			s.ops, s.bytes = out.Write.IOPS, out.Write.IOBytes
		case "mbps":
			s.bytes = out.Write.IOBytes
		case "p50":
			s.v = ms(out.Write.Clat.Percentile["50.000000"])
		case "p99":
			s.v = ms(out.Write.Clat.Percentile["99.000000"])
		case "max":
			s.v = ms(out.Write.Lat.Max)
		case "sync-p99":
			s.v = ms(out.Sync.Lat.Percentile["99.000000"])
		case "sync-max":
			s.v = ms(out.Sync.Lat.Max)
		case "cpu":
			if !okCPU || !okCPU1 {
				s.skipped = "n/a: no daemon (the file is written directly)"
				break
			}
			s.v = float64((cpu1 - cpu0).Microseconds()) / float64(out.Write.TotalIOs)
		case "host":
			var wb int64
			switch {
			case okWB && okWB1:
				wb = wb1 - wb0
			case okShell:
				wb = shellWB
			default:
				s.skipped = "n/a: not counted"
			}
			if s.skipped == "" {
				s.v = float64(wb) / float64(out.Write.IOBytes)
			}
		default:
			return nil, fmt.Errorf("bench: fio gives no metric %q", m.id)
		}
		ss = append(ss, s)
	}
	return ss, nil
}

// The copy-on-write pattern of issue 16: 64 KiB writes at a 1 KiB offset
// into an empty image with 64 KiB clusters, so that every write touches
// two clusters and needs copy-on-write at both ends (of nothing: the image
// is empty, so no zeros need writing). 1 GiB in all.
const (
	cowWrites = 16384
	cowJobs   = 4
	cowBytes  = cowWrites * 64 * kib
	// cowPattern is the byte qemu-img bench writes.
	cowPattern = 0xab
)

// qemuImgBenchArgs is the qemu-img bench command of the pattern.
func qemuImgBenchArgs(img string) []string {
	return []string{"bench", "-w", "-t", "none", "-f", "qcow2", "-c", strconv.Itoa(cowWrites), "-d", "64", "-s", "64k", "-o", "1k",
		fmt.Sprintf("--pattern=%d", cowPattern), img}
}

// measureCow runs the pattern with fio through the exposed file, or with
// qemu-img bench on the image itself.
func measureCow(b *bench, w *workload, c *contestant, e *exposure, run int) ([]sample, error) {
	if c.id != "qemu-img-bench" {
		return measureFioWrite(b, w, c, e, run)
	}
	name, args := ioShell("qemu-img", qemuImgBenchArgs(e.t.img)...)
	r := b.run(&cmd{name: name, args: args, timeout: 5 * time.Minute})
	s, err := r.sample("mbps")
	if err != nil {
		return []sample{s}, err
	}
	stdout, wb, ok := splitIO(r.stdout)
	s.bytes = cowBytes
	if run == 1 {
		s.note = "qemu-img bench says: " + strings.TrimSuffix(lastLines(stdout, 1), ".")
	}
	h := sample{metric: "host", seconds: s.seconds, v: float64(wb) / float64(cowBytes)}
	if !ok {
		h.skipped = "n/a: not counted"
	}
	return []sample{s, h}, nil
}

// verifyCow checks the pattern's data: fio's blocks, or qemu-img bench's
// pattern byte over exactly the range it wrote and zeros elsewhere.
func verifyCow(b *bench, w *workload, t *target) (string, error) {
	if !strings.HasSuffix(t.dir, "-qemu-img-bench") {
		return verifyFio(b, w, t)
	}
	file, done, err := b.qemuRaw(t)
	if err != nil {
		return "", err
	}
	defer done()
	if err := checkPattern(file, kib, kib+cowBytes, cowPattern); err != nil {
		return "", err
	}
	return fmt.Sprintf("qemu-img convert: bytes 1 KiB to 1 GiB+1 KiB are 0x%x, the rest zero", cowPattern), nil
}

// checkPattern reads file (its data extents; holes read as zeros) and
// checks that [from, to) holds the byte p and everything else is zero.
func checkPattern(file string, from, to int64, p byte) error {
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	const seekData, seekHole = 3, 4
	buf := make([]byte, 4*mib)
	for off := int64(0); off < st.Size(); {
		data, err := f.Seek(off, seekData)
		if err != nil {
			break // ENXIO: no data after off
		}
		if data > off && from < data && to > off {
			return fmt.Errorf("%s: bytes %d to %d are a hole, want 0x%x from %d", file, off, data, p, max(off, from))
		}
		hole, err := f.Seek(data, seekHole)
		if err != nil {
			return err
		}
		for pos := data; pos < hole; {
			n, err := f.ReadAt(buf[:min(int64(len(buf)), hole-pos)], pos)
			if n == 0 && err != nil {
				return err
			}
			for i, c := range buf[:n] {
				o := pos + int64(i)
				want := byte(0)
				if o >= from && o < to {
					want = p
				}
				if c != want {
					return fmt.Errorf("%s: byte %d is 0x%x, want 0x%x", file, o, c, want)
				}
			}
			pos += int64(n)
		}
		off = hole
	}
	return nil
}

// The sequential write: 2 GiB of the plain image's raw twin (real files)
// written 1 MiB at a time into an empty image, O_DIRECT, then fsync.
const seqBytes = 2 * gib

func prepareSeq(b *bench, w *workload) error {
	// The source in the page cache, so that every run reads it from
	// memory.
	_, err := b.must(&cmd{name: "dd", args: []string{"if=" + b.rawPath("plain"), "of=/dev/null", "bs=4M", "status=none"}, timeout: 5 * time.Minute})
	return err
}

func measureSeq(b *bench, w *workload, c *contestant, e *exposure, run int) ([]sample, error) {
	r := b.run(&cmd{name: "dd", args: []string{"if=" + b.rawPath("plain"), "of=" + e.file, "bs=1M", "count=" + strconv.FormatInt(seqBytes/mib, 10),
		"iflag=fullblock", "oflag=direct", "conv=notrunc,fsync"}, timeout: 5 * time.Minute, stuck: b.abortExposure(e)})
	s, err := r.sample("mbps")
	if err != nil {
		return []sample{s}, err
	}
	m := ddBytes.FindStringSubmatch(r.stderr)
	if m == nil {
		return []sample{s}, fmt.Errorf("dd: no byte count in %q", lastLines(r.stderr, 2))
	}
	s.bytes, _ = strconv.ParseInt(m[1], 10, 64)
	if s.bytes != seqBytes {
		return []sample{s}, fmt.Errorf("dd wrote %d bytes, want %d", s.bytes, seqBytes)
	}
	return []sample{s}, nil
}

// verifySeq compares the image with its source through qemu: the first
// 2 GiB equal to the plain image's raw twin, the rest zero (qemu-img
// compare of images of different sizes wants the rest unallocated or
// zero).
func verifySeq(b *bench, w *workload, t *target) (string, error) {
	format := "qcow2"
	if t.raw {
		format = "raw"
	}
	r := b.run(&cmd{name: "qemu-img", args: []string{"compare", "-q", "-f", "raw", "-F", format, b.rawPath("plain"), t.img}, timeout: 5 * time.Minute})
	if r.exitCode != 0 {
		return "", fmt.Errorf("qemu-img compare with the source: exit status %d: %s", r.exitCode, lastLines(r.stdout+"\n"+r.stderr, 2))
	}
	return "qemu-img compare: equal to the source", nil
}

// The guest file system: mkfs.ext4 on a loop device over the exposed file
// of an empty image, the file tree untarred into it, synced; then a part
// deleted and fstrim.
const (
	treeShareMiB = 192 // of the tree's files, from /usr/share
	treeLibMiB   = 128 // from /usr/lib; deleted before fstrim
)

func (b *bench) treeTar() string { return filepath.Join(b.cfg.work, "src", "tree.tar") }

// prepareTree makes the tar of the file tree once (cached in the work
// folder): files from /usr/share and /usr/lib, in lexical order.
func prepareTree(b *bench, w *workload) error {
	if exists(b.treeTar()) {
		return nil
	}
	dir := filepath.Dir(b.treeTar())
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	stage := filepath.Join(dir, "tree.stage")
	os.RemoveAll(stage)
	defer os.RemoveAll(stage)
	for _, src := range []struct {
		from, to string
		budget   int64
	}{{"/usr/share", "share", treeShareMiB * mib}, {"/usr/lib", "lib", treeLibMiB * mib}} {
		if _, err := copyTree(src.from, filepath.Join(stage, src.to), src.budget); err != nil {
			return err
		}
	}
	return b.atomically(b.treeTar(), func(tmp string) error {
		_, err := b.must(&cmd{name: "tar", args: []string{"-cf", tmp, "-C", stage, "share", "lib"}, timeout: 10 * time.Minute})
		return err
	})
}

func measureGuestWrite(b *bench, w *workload, c *contestant, e *exposure, run int) ([]sample, error) {
	out, err := b.must(&cmd{name: "losetup", args: []string{"-f", "--show", e.file}, timeout: time.Minute, stuck: b.abortExposure(e)})
	if err != nil {
		return nil, err
	}
	dev := strings.TrimSpace(out)
	if !strings.HasPrefix(dev, "/dev/loop") {
		return nil, fmt.Errorf("losetup attached %s to %q", e.file, dev)
	}
	// Pushed after the unmount of the image: undone first.
	detach := b.push("detach "+dev, func() error {
		_, err := b.must(&cmd{name: "losetup", args: []string{"-d", dev}, timeout: time.Minute, cleanup: true})
		return err
	})
	e.undos = append(e.undos, detach)
	dir, err := b.mountDir(c.id+"-guest", false)
	if err != nil {
		return nil, err
	}
	unmount := b.push("unmount "+dir, func() error {
		if isMounted(dir) {
			if _, err := b.must(&cmd{name: "umount", args: []string{dir}, timeout: 2 * time.Minute, cleanup: true}); err != nil {
				syscall.Unmount(dir, syscall.MNT_DETACH)
			}
		}
		if isMounted(dir) {
			return fmt.Errorf("%s: still mounted", dir)
		}
		os.Remove(dir)
		return nil
	})
	e.undos = append(e.undos, unmount)
	script := fmt.Sprintf("set -e; mkfs.ext4 -q -F %s; mount -t ext4 %s %s; tar -xf %s -C %s; sync -f %s",
		dev, dev, dir, b.treeTar(), dir, dir)
	r := b.run(&cmd{name: "bash", args: []string{"-c", script}, timeout: 10 * time.Minute, stuck: b.abortExposure(e)})
	s1, err := r.sample("time")
	if err != nil {
		return []sample{s1}, err
	}
	tarSize, _ := fileSize(b.treeTar())
	s1.bytes = tarSize
	if _, err := b.must(&cmd{name: "bash", args: []string{"-c", "rm -rf lib && sync -f ."}, dir: dir, timeout: 5 * time.Minute, stuck: b.abortExposure(e)}); err != nil {
		return []sample{s1}, err
	}
	e.t.allocBefore, _ = allocated(e.t.img)
	r = b.run(&cmd{name: "fstrim", args: []string{"-v", dir}, timeout: 5 * time.Minute, stuck: b.abortExposure(e)})
	s2, err := r.sample("fstrim")
	if err != nil {
		return []sample{s1, s2}, err
	}
	// Everything durable before the image is closed: the guest
	// unmounted, the loop device detached.
	if err := b.undo(unmount); err != nil {
		return []sample{s1, s2}, err
	}
	if err := b.undo(detach); err != nil {
		return []sample{s1, s2}, err
	}
	after, _ := allocated(e.t.img)
	if run == 1 {
		s2.note = fmt.Sprintf("%s; image file %s before fstrim, %s after", strings.TrimSpace(r.stdout), humanBytes(e.t.allocBefore), humanBytes(after))
	}
	return []sample{s1, s2}, nil
}

// verifyGuest checks the guest file system as qemu reads it from the
// closed image: e2fsck -fn clean, and the files kept equal to the tar's.
func verifyGuest(b *bench, w *workload, t *target) (string, error) {
	file, done, err := b.qemuRaw(t)
	if err != nil {
		return "", err
	}
	defer done()
	if _, err := b.must(&cmd{name: "e2fsck", args: []string{"-fn", file}, timeout: 5 * time.Minute}); err != nil {
		return "", err
	}
	dir := filepath.Join(b.cfg.work, "mnt", "check-guest")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	defer os.Remove(dir)
	if _, err := b.must(&cmd{name: "mount", args: []string{"-t", "ext4", "-o", "loop,ro,noload", file, dir}, timeout: time.Minute}); err != nil {
		return "", err
	}
	defer b.must(&cmd{name: "umount", args: []string{dir}, timeout: time.Minute, cleanup: true})
	if _, err := b.must(&cmd{name: "tar", args: []string{"-d", "-f", b.treeTar(), "-C", dir, "share"}, timeout: 5 * time.Minute}); err != nil {
		return "", err
	}
	if exists(filepath.Join(dir, "lib")) {
		return "", errors.New("lib/, deleted before fstrim, is still there")
	}
	how := "qemu-img convert, then "
	if t.raw {
		how = ""
	}
	return how + "e2fsck -fn clean, tar -d of the files kept: equal", nil
}

func fileSize(p string) (int64, error) {
	st, err := os.Stat(p)
	if err != nil {
		return 0, err
	}
	return st.Size(), nil
}

// runsNote says which workloads run fewer times than the others, for the
// report's method row: "every workload", or e.g. "3 in dd-deflate,
// cp-zstd, the write workloads and the remote workloads".
func (b *bench) runsNote() string {
	byRuns := map[int][]string{}
	var counts []int
	groups := map[string]bool{}
	for _, r := range b.results {
		n := b.runsOf(r.w)
		if n == b.cfg.runs {
			continue
		}
		name := r.w.id
		switch {
		case r.w.write != nil:
			name = "the write workloads"
		case r.w.remote != nil:
			name = "the remote workloads"
		}
		key := fmt.Sprint(n, name)
		if groups[key] {
			continue
		}
		groups[key] = true
		if len(byRuns[n]) == 0 {
			counts = append(counts, n)
		}
		byRuns[n] = append(byRuns[n], name)
	}
	if len(counts) == 0 {
		return "every workload"
	}
	var parts []string
	for _, n := range counts {
		names := byRuns[n]
		list := strings.Join(names, ", ")
		if len(names) > 1 {
			list = strings.Join(names[:len(names)-1], ", ") + " and " + names[len(names)-1]
		}
		parts = append(parts, fmt.Sprintf("%d in %s", n, list))
	}
	return strings.Join(parts, "; ")
}
