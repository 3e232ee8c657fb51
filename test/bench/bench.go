package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// A bench is one run of the suite: its configuration, what it has set up
// (to be torn down) and what it measured.
type bench struct {
	ctx  context.Context
	cfg  config
	repo string
	log  io.Writer // the detailed log: every command, every error
	logF *os.File
	lock *os.File // flock'ed for the whole run

	mu    sync.Mutex // guards undos, seq and writes to log
	undos []*undo
	seq   int

	canDrop        bool   // root may drop the page cache here
	dropWhy        string // why not, when not
	mountedFusectl bool
	tmpfsUp        bool
	builtNow       time.Duration // images built by this run (0: all cached)
	start          time.Time
	qcowfsVersion  string
	loadBefore     string  // /proc/loadavg when the measurements start
	loadBefore1    float64 // its 1-minute average
	results        []*wlResult
	// compressed caches the compressed cluster count per image name
	// (syscalls.go).
	compressed map[string]int64
	// verified names, per "contestant image", the workload where a copy
	// of that contestant was found equal to the raw twin (measureCopy).
	verified map[string]string
	// net is the HTTP server and delaying proxies of the remote
	// workloads (remote.go), started by the first of them.
	net *remoteNet
	// underStrace, during a syscall pass (syscalls.go), is the strace
	// command line the next exposure's daemon starts under.
	underStrace []string
}

func newBench(ctx context.Context, cfg config, repo string) (*bench, error) {
	b := &bench{ctx: ctx, cfg: cfg, repo: repo, start: time.Now(), compressed: map[string]int64{}, verified: map[string]string{}}
	if err := os.MkdirAll(filepath.Join(cfg.work, "logs"), 0o755); err != nil {
		return nil, err
	}
	// One run per work folder: a second one would unmount the first
	// one's mounts as leftovers.
	lock, err := os.OpenFile(filepath.Join(cfg.work, "bench.lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		lock.Close()
		return nil, fmt.Errorf("another bench run is using %s (%v)", cfg.work, err)
	}
	b.lock = lock
	// The daemons' logs of the last run go; the bench's own logs stay.
	old, _ := filepath.Glob(filepath.Join(cfg.work, "logs", "[0-9]*.log"))
	for _, p := range old {
		os.Remove(p)
	}
	name := "bench-" + b.start.Format("20060102-150405")
	if cfg.quick {
		name += "-quick"
	}
	f, err := os.Create(b.logPath(name))
	if err != nil {
		return nil, err
	}
	b.logF = f
	b.log = &lockedWriter{w: f, mu: &b.mu}
	return b, nil
}

type lockedWriter struct {
	w  io.Writer
	mu *sync.Mutex
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// say prints a progress line and logs it.
func (b *bench) say(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	fmt.Println(msg)
	fmt.Fprintln(b.log, "## "+msg)
}

func (b *bench) warn(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	fmt.Fprintln(os.Stderr, "bench: warning:", msg)
	fmt.Fprintln(b.log, "## warning: "+msg)
}

// close tears down everything still set up and checks nothing is left.
func (b *bench) close() {
	b.undoAll()
	b.cleanStale()
	if b.mountedFusectl && isMounted(fusectlDir) {
		syscall.Unmount(fusectlDir, 0)
	}
	for _, m := range mounts() {
		if strings.HasPrefix(m.Point, b.cfg.work+"/") {
			b.warn("still mounted: %s (%s)", m.Point, m.FSType)
		}
	}
	if b.logF != nil {
		b.logF.Close()
	}
	if b.lock != nil {
		b.lock.Close()
	}
}

// main runs the suite: check the machine, build qcowfs and the images,
// run every workload of the plan, write the report.
func (b *bench) main() error {
	b.say("qcowfs bench (%s): work folder %s, log %s", b.mode(), b.cfg.work, b.logF.Name())
	if err := b.preflight(); err != nil {
		return err
	}
	b.cleanStale()
	if err := b.buildQcowfs(); err != nil {
		return err
	}
	plan := b.plan()
	if len(plan) == 0 {
		return fmt.Errorf("--only %q matches no workload of the %s plan", strings.Join(b.cfg.only, ","), b.mode())
	}
	var need []*image
	for _, w := range plan {
		names := []string{w.image}
		if w.write != nil {
			names = w.write.uses
		}
		for _, n := range names {
			if n == "" {
				continue
			}
			if im := imageByName(n); !slices.Contains(need, im) {
				need = append(need, im)
			}
		}
	}
	if err := b.buildImages(need); err != nil {
		return err
	}
	if b.cfg.imagesOnly {
		return nil
	}
	b.loadBefore, b.loadBefore1 = loadavg(), load1()
	if b.loadBefore1 > float64(runtime.NumCPU())/2 {
		b.warn("the machine is busy (load average %.1f on %d cores): the numbers will be noisy", b.loadBefore1, runtime.NumCPU())
	}
	for _, w := range plan {
		if b.ctx.Err() != nil {
			break
		}
		res := b.runWorkload(w)
		if b.ctx.Err() != nil {
			break
		}
		b.results = append(b.results, res)
		fmt.Println()
		fmt.Print(b.markdownWorkload(res))
	}
	b.undoAll()
	if b.ctx.Err() != nil {
		return fmt.Errorf("interrupted: no report written")
	}
	if err := b.writeReport(); err != nil {
		return err
	}
	fmt.Println()
	fmt.Print(b.markdownSummary())
	b.say("report: %s (raw numbers: %s); total %s", b.cfg.report, jsonPath(b.cfg.report), time.Since(b.start).Round(time.Second))
	return nil
}

func (b *bench) mode() string {
	if b.cfg.quick {
		return "quick"
	}
	return "full"
}

// A tool is an executable the bench needs and the Debian package that
// has it.
type tool struct{ name, pkg string }

var coreTools = []tool{
	{"dd", "coreutils"}, {"cp", "coreutils"}, {"stat", "coreutils"}, {"sync", "coreutils"}, {"wc", "coreutils"},
	{"bash", "bash"}, {"tar", "tar"}, {"make", "make"},
	{"qemu-img", "qemu-utils"}, {"qemu-io", "qemu-utils"}, {"fio", "fio"},
	{"losetup", "util-linux"}, {"partx", "util-linux"}, {"fincore", "util-linux"}, {"mount", "mount"}, {"umount", "mount"},
	{"sfdisk", "fdisk"}, {"mkfs.ext4", "e2fsprogs"}, {"fusermount3", "fuse3"},
	{"time", "time"}, // GNU time: the check workload's peak RSS (check.go)
}

// straceTool counts the daemons' system calls (syscalls.go); without it
// the counts are "n/a" and everything else runs.
var straceTool = tool{"strace", "strace"}

// preflight checks root, FUSE and every tool, installing missing Debian
// packages with scripts/deps.sh (as root); tools of one contestant only
// (qemu-storage-daemon, qcowmount) make that contestant "n/a" instead, and
// a missing strace the syscall counts.
func (b *bench) preflight() error {
	if os.Geteuid() != 0 {
		return errors.New("needs root: FUSE mounts, loop devices, mount, dropping caches")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		return fmt.Errorf("needs /dev/fuse: %w", err)
	}
	all := append(slices.Clone(coreTools), straceTool)
	for _, c := range contestants {
		if c.pkg != "" {
			all = append(all, tool{c.tool, c.pkg})
		}
	}
	missing := func() (tools, pkgs []string) {
		for _, t := range all {
			if _, err := exec.LookPath(t.name); err != nil {
				tools = append(tools, t.name)
				if !slices.Contains(pkgs, t.pkg) {
					pkgs = append(pkgs, t.pkg)
				}
			}
		}
		return
	}
	if tools, pkgs := missing(); len(tools) > 0 {
		b.say("missing: %s; installing %s", strings.Join(tools, ", "), strings.Join(pkgs, " "))
		if _, err := b.must(&cmd{name: filepath.Join(b.repo, "scripts", "deps.sh"), args: pkgs, timeout: 15 * time.Minute}); err != nil {
			b.warn("installing packages: %v", err)
		}
	}
	tools, pkgs := missing()
	var coreMissing []string
	for _, t := range coreTools {
		if slices.Contains(tools, t.name) {
			coreMissing = append(coreMissing, fmt.Sprintf("%s (package %s)", t.name, t.pkg))
		}
	}
	if len(coreMissing) > 0 {
		return fmt.Errorf("missing tools: %s; install them (scripts/deps.sh %s)", strings.Join(coreMissing, ", "), strings.Join(pkgs, " "))
	}
	for _, t := range tools {
		if t == straceTool.name {
			b.warn("strace is missing: the syscall counts are n/a")
			continue
		}
		b.warn("%s is missing: its contestant is n/a in every table", t)
	}
	if err := dropCaches(); err != nil {
		b.dropWhy = err.Error()
		b.warn("cannot drop caches (%v): cold runs are first reads after a sync only", err)
	} else {
		b.canDrop = true
	}
	return nil
}

// cleanStale removes what an earlier run that was killed outright (no
// chance to clean up) left under the work folder: mounts, loop devices,
// and daemons serving them.
func (b *bench) cleanStale() {
	prefix := b.cfg.work + "/"
	// Loop devices first: they hold guest mounts and FUSE files.
	out, _ := exec.Command("losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE").Output()
	var loops []string
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) == 2 && strings.HasPrefix(f[1], prefix) {
			loops = append(loops, f[0])
		}
	}
	ms := mounts()
	for i := len(ms) - 1; i >= 0; i-- {
		m := ms[i]
		isLoopMount := false
		for _, l := range loops {
			if strings.HasPrefix(m.Source, l) {
				isLoopMount = true
			}
		}
		if isLoopMount {
			b.warn("unmounting a guest mount left behind: %s", m.Point)
			if syscall.Unmount(m.Point, 0) != nil {
				syscall.Unmount(m.Point, syscall.MNT_DETACH)
			}
		}
	}
	for _, l := range loops {
		b.warn("detaching a loop device left behind: %s", l)
		exec.Command("partx", "-d", l).Run()
		exec.Command("losetup", "-d", l).Run()
	}
	ms = mounts()
	for i := len(ms) - 1; i >= 0; i-- {
		m := ms[i]
		if strings.HasPrefix(m.Point, prefix) && m.Point != b.tmpfsDir() {
			b.warn("unmounting a mount left behind: %s (%s)", m.Point, m.FSType)
			if err := b.forceUnmount(m.Point); err != nil {
				b.warn("%v", err)
			}
		}
	}
	if !b.tmpfsUp && isMounted(b.tmpfsDir()) {
		b.warn("unmounting a tmpfs left behind: %s", b.tmpfsDir())
		b.forceUnmount(b.tmpfsDir())
	}
	// Their mount points go too: mountDir numbers new ones from 001 in
	// every run, and would find the old names taken. Only empty, unmounted
	// folders and files: nothing a mount point does not leave.
	ents, _ := os.ReadDir(filepath.Join(b.cfg.work, "mnt"))
	for _, e := range ents {
		p := filepath.Join(b.cfg.work, "mnt", e.Name())
		if st, err := os.Stat(p); err == nil && !isMounted(p) && (st.Mode().IsRegular() && st.Size() == 0 || st.IsDir()) {
			os.Remove(p) // fails, harmlessly, for a folder that is not empty
		}
	}
	// Daemons whose mounts went away exit by themselves; give them a
	// moment, then stop the ones still serving a folder under work.
	for _, exe := range []string{"qemu-storage-daemon", "qcowmount", filepath.Base(b.cfg.bin)} {
		for _, pid := range daemonsUnder(exe, prefix) {
			if !waitGone(pid, 2*time.Second) {
				b.warn("stopping a %s (pid %d) left behind", exe, pid)
				syscall.Kill(pid, syscall.SIGTERM)
				if !waitGone(pid, 5*time.Second) {
					syscall.Kill(pid, syscall.SIGKILL)
				}
			}
		}
	}
}

// daemonsUnder lists processes of executable exe with an argument that
// names something under prefix.
func daemonsUnder(exe, prefix string) []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		var pid int
		if _, err := fmt.Sscan(e.Name(), &pid); err != nil {
			continue
		}
		data, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil || len(data) == 0 {
			continue
		}
		argv := strings.Split(strings.TrimRight(string(data), "\x00"), "\x00")
		if filepath.Base(argv[0]) != exe || pid == os.Getpid() {
			continue
		}
		for _, a := range argv[1:] {
			if strings.Contains(a, prefix) && procAlive(pid) {
				pids = append(pids, pid)
				break
			}
		}
	}
	return pids
}

// buildQcowfs runs `make build` and measures a copy of the binary, so
// that a rebuild by someone else during the run does not change what is
// measured half way.
func (b *bench) buildQcowfs() error {
	if b.cfg.build {
		b.say("make build")
		if _, err := b.must(&cmd{name: "make", args: []string{"-C", b.repo, "build"}, timeout: 10 * time.Minute}); err != nil {
			return err
		}
	}
	if _, err := os.Stat(b.cfg.bin); err != nil {
		return fmt.Errorf("the qcowfs binary: %w", err)
	}
	snap := filepath.Join(b.cfg.work, "bin", "qcowfs")
	if err := os.MkdirAll(filepath.Dir(snap), 0o755); err != nil {
		return err
	}
	os.Remove(snap)
	if _, err := b.must(command("cp", b.cfg.bin, snap)); err != nil {
		return err
	}
	out, err := b.must(command(snap, "version"))
	if err != nil {
		return err
	}
	b.qcowfsVersion = strings.TrimSpace(out)
	if desc, err := exec.Command("git", "-C", b.repo, "describe", "--tags", "--always", "--dirty").Output(); err == nil {
		if d := strings.TrimSpace(string(desc)); !strings.Contains(b.qcowfsVersion, d) {
			b.qcowfsVersion += " (tree: " + d + ")"
		}
	}
	b.cfg.bin = snap
	return nil
}

// The tmpfs holds copies of the images for the workloads that read them
// from memory, and the outputs of the copies that are written there.
func (b *bench) tmpfsDir() string { return filepath.Join(b.cfg.work, "tmpfs") }

// imageRoot is the folder holding img/ and raw/ that w reads.
func (b *bench) imageRoot(w *workload) string {
	if w.remote != nil {
		return b.remoteURL(w)
	}
	if w.tmpfs {
		return b.tmpfsDir()
	}
	return b.cfg.work
}

// ensureTmpfs mounts the tmpfs (once, sized for every image the plan
// puts there plus room for outputs) and copies w's image into it.
func (b *bench) ensureTmpfs(w *workload) error {
	dir := b.tmpfsDir()
	if !b.tmpfsUp {
		size := 4 * gib // room for outputs: the largest copy is 2 GiB
		for _, pw := range b.plan() {
			if pw.tmpfs {
				im := imageByName(pw.image)
				for _, p := range []string{b.qcowPath(im.name), b.rawPath(im.raw)} {
					n, _ := allocated(p)
					size += n
				}
			}
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		opts := fmt.Sprintf("size=%dm,mode=0755", roundUp(size, mib)/mib)
		if _, err := b.must(command("mount", "-t", "tmpfs", "-o", opts, "qcowfs-bench", dir)); err != nil {
			return err
		}
		b.tmpfsUp = true
		b.push("unmount the tmpfs "+dir, func() error {
			b.tmpfsUp = false
			return b.forceUnmount(dir)
		})
	}
	if !w.tmpfs {
		return nil
	}
	im := imageByName(w.image)
	for _, f := range [][2]string{
		{b.qcowPath(im.name), filepath.Join(dir, "img", im.name, im.name+".qcow2")},
		{b.rawPath(im.raw), filepath.Join(dir, "raw", im.raw+".raw")},
	} {
		if exists(f[1]) {
			continue
		}
		if err := os.MkdirAll(filepath.Dir(f[1]), 0o755); err != nil {
			return err
		}
		if _, err := b.must(command("cp", "--sparse=always", f[0], f[1])); err != nil {
			return err
		}
	}
	return nil
}

func jsonPath(report string) string {
	return strings.TrimSuffix(report, filepath.Ext(report)) + ".json"
}

// writeJSON writes v as indented JSON.
func writeJSON(path string, v any) error {
	data, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(data, '\n'), 0o644)
}

// loadavg is the first three fields of /proc/loadavg: other work on the
// machine during a run shows up here, and in the numbers.
func loadavg() string {
	data, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(data))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

// load1 is the 1-minute load average.
func load1() float64 {
	f := strings.Fields(loadavg())
	if len(f) == 0 {
		return 0
	}
	v, _ := strconv.ParseFloat(f[0], 64)
	return v
}
