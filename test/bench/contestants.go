package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// A role says how a contestant's numbers are read.
type role int

const (
	subject  role = iota // qcowfs, whose ratios the report gives
	ref                  // qcowfs built from another git revision (--ref), or with other options
	peer                 // the other FUSE exports, qemu-img check and map: "best peer"
	baseline             // no FUSE: the raw file, qemu-img convert and bench, curl
	probe                // qcowfs under strace: counts, not times; round 1 only
)

// A contestant is one way of doing a workload's work: a mount that serves
// the image as a raw file ($FILE), or a command of its own that the
// workload gives (qemu-img convert, curl, qemu-img bench).
type contestant struct {
	id, label string
	role      role
	bin       string // $BIN: the program the workload's command runs (qcowfs check, qemu-img check)
	flags     string // more flags for qcowfs mount
	// mount makes t's image readable (and with t.writable writable) as
	// t.file; nil for a contestant that only runs commands.
	mount  func(e *env, t *target, c *contestant) error
	format string // of the fresh images it writes: "raw" for the raw file, else qcow2
	clear  bool   // in an encrypted workload, the same data unencrypted
	how    string // for the report
}

// tunedMalloc is the environment of "qemu export, tuned": qemu allocates a
// bounce buffer per request, and buffers above glibc's mmap threshold
// (128 KiB) cost an mmap and a munmap each.
const tunedMalloc = "MALLOC_MMAP_THRESHOLD_=67108864"

// contestants returns the table; bin is the qcowfs binary measured.
func contestants(bin string) []*contestant {
	return []*contestant{
		{id: "raw", label: "raw file (no FUSE)", role: baseline, mount: exposeRaw, format: "raw",
			how: "the image's raw twin (for writes: a fresh raw file) read or written directly: the ceiling"},
		{id: "qcowfs", label: "qcowfs", role: subject, bin: bin, mount: mountQcowfs,
			how: "`qcowfs mount [--writable] DIR|URL MNT`, default options (over FUSE over io_uring where the run switched it on); `qcowfs unmount MNT` after the run"},
		{id: "qcowfs-devfuse", label: "qcowfs --io-uring=off", role: ref, bin: bin, flags: " --io-uring=off", mount: mountQcowfs,
			how: "qcowfs serving over /dev/fuse (a read and a write system call per request) instead of FUSE over io_uring"},
		{id: "qcowfs-nowb", label: "qcowfs --no-writeback-cache", role: ref, bin: bin, flags: " --no-writeback-cache", mount: mountQcowfs,
			how: "qcowfs without the kernel's writeback cache: every buffered write crosses FUSE"},
		{id: "qcowfs-overlay", label: "qcowfs --writable --overlay=temp", role: ref, bin: bin, flags: " --writable --overlay=temp", mount: mountQcowfs,
			how: "qcowfs with a throwaway overlay over the image: reads go through the overlay to its (remote) base"},
		{id: "qcowfs-hydrated", label: "qcowfs, hydrated", role: ref, bin: bin, flags: ` --hydrate --cache-dir "$RUN/cache" --cache-dir-size 8G`, mount: mountHydrated,
			how: "qcowfs with `--hydrate --cache-dir DIR --cache-dir-size 8G`: the image opened and its hydration waited for (untimed) before the run"},
		{id: "qcowfs-local", label: "qcowfs, local image", role: ref, bin: bin, mount: mountLocal,
			how: "qcowfs mounting the remote image's local file: what a hydrated image should read like"},
		{id: "qemu", label: "qemu export", role: peer, mount: mountQemu(""),
			how: "`qemu-storage-daemon --blockdev driver=file|http,... --blockdev driver=qcow2,... --export type=fuse,writable=off|on`; " +
				"read-only=on on both nodes for reads, discard=unmap for writes; SIGTERM after the run"},
		{id: "qemu-tuned", label: "qemu export, tuned", role: peer, mount: mountQemu(tunedMalloc),
			how: "the same with `" + tunedMalloc + "`: no mmap and munmap per request buffer"},
		{id: "qcowfs-clear", label: "qcowfs, unencrypted", role: ref, bin: bin, mount: mountQcowfs, clear: true,
			how: "in an encrypted workload, qcowfs on the same data unencrypted: the cost of encryption"},
		{id: "qemu-clear", label: "qemu export, unencrypted", role: ref, mount: mountQemu(""), clear: true,
			how: "the same for qemu's export"},
		{id: "qcowmount", label: "qcowmount", role: peer, mount: mountQcowmount,
			how: "libqcow's `qcowmount IMG MNT`, the file MNT/qcow1; `fusermount3 -u` after the run"},
		{id: "convert", label: "qemu-img convert", role: baseline, how: "`qemu-img convert -f qcow2 -O raw IMG|URL OUT`"},
		{id: "curl", label: "curl (whole file)", role: baseline, how: "`curl -o OUT URL` of the qcow2 file: the download alone"},
		{id: "qemu-img-bench", label: "qemu-img bench", role: baseline, how: "`qemu-img bench -w`: qemu's own write path on the image, no FUSE"},
		{id: "qemu-img", label: "qemu-img", role: peer, bin: "qemu-img", how: "`qemu-img check|map IMG`, the reference"},
		{id: "qcowfs-strace", label: "qcowfs under strace", role: probe, bin: bin, mount: mountStraced,
			how: "qcowfs with `strace -f -c -p DAEMON -P IMG` attached for one run (untimed): host calls on the image file"},
	}
}

// refContestant is qcowfs built from git revision rev (main.go builds it).
func refContestant(rev, bin string) *contestant {
	return &contestant{id: "qcowfs@" + rev, label: "qcowfs " + rev, role: ref, bin: bin, mount: mountQcowfs,
		how: "qcowfs built from " + rev + ", mounted as qcowfs is"}
}

func exposeRaw(e *env, t *target, c *contestant) error {
	t.file = t.raw
	if t.writable {
		t.file = t.img
	}
	return nil
}

// mountQcowfs mounts the folder that holds just the image (every qcowfs
// build mounts folders), or the URL.
func mountQcowfs(e *env, t *target, c *contestant) error {
	src, flags := filepath.Dir(t.img), c.flags
	if t.url != "" {
		src = t.url
	}
	if t.writable {
		flags += " --writable"
	}
	if t.s3 != "" {
		flags += " --s3-endpoint " + t.s3
	}
	if t.key != "" {
		flags += ` --key-file "$KEY"`
	}
	t.mnt = filepath.Join(t.dir, "mnt")
	if err := os.Mkdir(t.mnt, 0o755); err != nil {
		return err
	}
	vars := append([]string{"BIN=" + c.bin, "SRC=" + src, "MNT=" + t.mnt, "LOG=" + t.dir + "/daemon.log"}, t.vars...)
	if _, err := e.sh(`"$BIN" mount`+flags+` --log-file "$LOG" "$SRC" "$MNT"`, vars...); err != nil {
		return err
	}
	stem := strings.TrimSuffix(filepath.Base(t.img), ".qcow2")
	t.file, t.pid = filepath.Join(t.mnt, stem+".raw"), daemonOf(t.mnt)
	t.down(func() error {
		if !t.hung {
			e.sh(`"$BIN" unmount "$MNT"`, vars...)
		}
		return e.stopped(t, "qcowfs", 0)
	})
	return nil
}

// mountHydrated mounts as qcowfs does (with the contestant's --hydrate
// and a disk cache in the run's folder), opens the image, which starts
// its hydration, and waits until qcowfs status says it is complete.
func mountHydrated(e *env, t *target, c *contestant) error {
	if err := os.Mkdir(filepath.Join(t.dir, "cache"), 0o755); err != nil {
		return err
	}
	if err := mountQcowfs(e, t, c); err != nil {
		return err
	}
	_, err := e.sh(`head -c 1 "$FILE" > /dev/null
for i in $(seq 1200); do
  s=$("$BIN" status "$MNT") || exit 1
  case "$s" in *": running"*) ;; *": complete"*) exit 0 ;; *": bounded"* | *": failed"* | *": stopped"*) echo "$s"; exit 1 ;; esac
  sleep 0.25
done
echo "the hydration did not complete: $s"; exit 1`, append(t.vars, "FILE="+t.file, "MNT="+t.mnt, "BIN="+c.bin)...)
	return err
}

// mountLocal mounts the local file of a remote workload's image, as
// qcowfs mounts a local image.
func mountLocal(e *env, t *target, c *contestant) error {
	url, s3, img := t.url, t.s3, t.img
	t.url, t.s3, t.img = "", "", t.local
	defer func() { t.url, t.s3, t.img = url, s3, img }()
	return mountQcowfs(e, t, c)
}

// daemonOf is the process serving the mount at mnt: the one with mnt as
// an argument.
func daemonOf(mnt string) int {
	if pids := pidsNaming(mnt + "\x00"); len(pids) > 0 {
		return pids[0]
	}
	return 0
}

// stopped unmounts t.mnt if its daemon has not, and waits for the daemon
// to exit (a writable image is closed then), sending sig first if not 0.
func (e *env) stopped(t *target, what string, sig syscall.Signal) error {
	if sig != 0 && t.pid != 0 {
		syscall.Kill(t.pid, sig)
	}
	if t.pid == 0 || waitGone(t.pid, 30*time.Second) {
		e.forceUnmount(t.mnt)
		return nil
	}
	e.forceUnmount(t.mnt)
	syscall.Kill(t.pid, syscall.SIGKILL)
	return fmt.Errorf("%s daemon %d did not exit within 30 s; killed", what, t.pid)
}

// mountQemu exports the image with qemu-storage-daemon, over a file or,
// for a URL, over qemu's curl driver, with the malloc tuning if set, with
// its secret if the image is encrypted.
func mountQemu(malloc string) func(e *env, t *target, c *contestant) error {
	return func(e *env, t *target, c *contestant) error {
		t.mnt = filepath.Join(t.dir, "mnt.raw") // qemu's FUSE export mounts on a file
		if err := os.WriteFile(t.mnt, nil, 0o644); err != nil {
			return err
		}
		node := "driver=file,node-name=file0,aio=threads,filename=" + t.img
		if t.url != "" {
			node = "driver=http,node-name=file0,url=" + t.url
		}
		// read-only=on: two exports and qemu-img convert open the same
		// image, and qemu's locking refuses a second read-write opener.
		opts, export := ",read-only=on", ",writable=off"
		if t.writable {
			opts, export = ",discard=unmap", ",writable=on" // fstrim gives space back
		}
		var secret []string
		fmtOpts := opts
		if t.key != "" {
			secret, fmtOpts = []string{"--object", "secret,id=s0,file=" + t.key}, opts+",encrypt.format=luks,encrypt.key-secret=s0"
		}
		cmd := exec.Command("qemu-storage-daemon", append(secret, "--blockdev", node+opts,
			"--blockdev", "driver=qcow2,node-name=fmt0,file=file0"+fmtOpts,
			"--export", "type=fuse,id=exp0,node-name=fmt0,mountpoint="+t.mnt+export)...)
		cmd.Env = append(os.Environ(), malloc)
		log, err := os.Create(filepath.Join(t.dir, "daemon.log"))
		if err != nil {
			return err
		}
		defer log.Close()
		cmd.Stdout, cmd.Stderr = log, log
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		e.logf("$ %s %s &", malloc, strings.Join(cmd.Args, " "))
		if err := cmd.Start(); err != nil {
			return err
		}
		go cmd.Wait()
		t.file, t.pid = t.mnt, cmd.Process.Pid
		t.down(func() error {
			sig := syscall.SIGTERM // flushes and closes a writable image
			if t.hung {
				sig = syscall.SIGKILL // a daemon waiting on curl ignores SIGTERM
			}
			return e.stopped(t, "qemu-storage-daemon", sig)
		})
		if !waitFor(30*time.Second, func() bool { return isMounted(t.mnt) || !alive(t.pid) }) || !alive(t.pid) {
			msg, _ := os.ReadFile(log.Name())
			return fmt.Errorf("qemu-storage-daemon did not mount: %s", tail(string(msg), 2))
		}
		return nil
	}
}

func mountQcowmount(e *env, t *target, c *contestant) error {
	t.mnt = filepath.Join(t.dir, "mnt")
	if err := os.Mkdir(t.mnt, 0o755); err != nil {
		return err
	}
	// It detaches itself and returns before the mount is live.
	if _, err := e.sh(`qcowmount "$IMG" "$MNT" > /dev/null`, "IMG="+t.img, "MNT="+t.mnt); err != nil {
		return err
	}
	if !waitFor(30*time.Second, func() bool { return isMounted(t.mnt) }) {
		return fmt.Errorf("qcowmount: %s not mounted after 30 s", t.mnt)
	}
	t.file, t.pid = filepath.Join(t.mnt, "qcow1"), daemonOf(t.mnt)
	t.down(func() error {
		if !t.hung {
			e.sh(`fusermount3 -u "$MNT"`, "MNT="+t.mnt)
		}
		return e.stopped(t, "qcowmount", 0)
	})
	return nil
}

// straced are the calls the probe counts: ioctl is FIEMAP, the only ioctl
// qcowfs makes on an image (issue 4); the rest read it (issue 5).
const straced = "lseek,ioctl,pread64,read,preadv,preadv2"

// mountStraced mounts with qcowfs and attaches strace to the daemon until
// the run ends. -P keeps the calls on the image file only, not the reads
// of /dev/fuse. Attached after the mount, it counts what the command
// causes (and the daemon's background count of allocated blocks).
func mountStraced(e *env, t *target, c *contestant) error {
	if err := mountQcowfs(e, t, c); err != nil {
		return err
	}
	out := filepath.Join(t.dir, "strace.txt")
	cmd := exec.Command("strace", "-f", "-c", "-o", out, "-P", t.img, "-e", "trace="+straced, "-p", strconv.Itoa(t.pid))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.down(func() error { // before the unmount: strace -c reports when it detaches
		cmd.Process.Signal(syscall.SIGINT)
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
			return fmt.Errorf("strace did not detach")
		}
		text, err := os.ReadFile(out)
		if err != nil {
			return err
		}
		t.vals = straceCounts(string(text))
		out, _ := e.sh(`qemu-img check --output=json "$IMG"`, "IMG="+t.img)
		var check struct {
			Compressed float64 `json:"compressed-clusters"`
		}
		json.Unmarshal([]byte(out), &check)
		t.vals["clusters"] = check.Compressed
		return nil
	})
	if !waitFor(10*time.Second, func() bool { return tracerOf(t.pid) != 0 }) {
		return fmt.Errorf("strace did not attach to %d", t.pid)
	}
	return nil
}

// tracerOf is TracerPid of /proc/PID/status.
func tracerOf(pid int) int {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	_, v, _ := strings.Cut(string(b), "TracerPid:")
	n, _ := strconv.Atoi(strings.TrimSpace(strings.SplitN(v, "\n", 2)[0]))
	return n
}

// straceCounts reads strace -c's table into lseek, fiemap and reads:
//
//	% time     seconds  usecs/call     calls    errors syscall
//	 97.12    0.004512           2      1870           pread64
func straceCounts(text string) map[string]float64 {
	v := map[string]float64{"lseek": 0, "fiemap": 0, "reads": 0}
	for _, line := range strings.Split(text, "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		n, err := strconv.ParseFloat(f[3], 64)
		switch name := f[len(f)-1]; {
		case err != nil:
		case name == "lseek":
			v["lseek"] += n
		case name == "ioctl":
			v["fiemap"] += n
		case strings.Contains(straced, name) && strings.Contains(name, "read"):
			v["reads"] += n
		}
	}
	return v
}

// daemonMeter reads a daemon's CPU time (user and system, all threads,
// /proc/PID/stat in USER_HZ ticks) and what it has passed to write
// system calls (wchar of /proc/PID/io: host writes, and its FUSE replies).
func daemonMeter(pid int) func() map[string]float64 {
	return func() map[string]float64 {
		v := map[string]float64{}
		if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid)); err == nil {
			s := string(b)
			f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
			ut, _ := strconv.ParseFloat(f[11], 64)
			st, _ := strconv.ParseFloat(f[12], 64)
			v["cpu"] = (ut + st) / 100
		}
		if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/io", pid)); err == nil {
			_, w, _ := strings.Cut(string(b), "wchar:")
			v["wchar"], _ = strconv.ParseFloat(strings.TrimSpace(strings.SplitN(w, "\n", 2)[0]), 64)
		}
		return v
	}
}

// peakRSS is a process's VmHWM in bytes.
func peakRSS(pid int) int64 {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	_, v, _ := strings.Cut(string(b), "VmHWM:")
	kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(strings.SplitN(v, "\n", 2)[0]), " kB"), 10, 64)
	return kb << 10
}
