package main

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// A role says how a contestant's numbers are read: qcowfs is the subject;
// peers are the other FUSE readers of qcow2 ("best peer" is the best of
// them); baselines do without FUSE (the raw file: the ceiling; qemu-img
// convert: what a copy costs without any mount).
type role int

const (
	subject role = iota
	peer
	baseline
)

// A contestant is one way of reading an image.
type contestant struct {
	id    string
	label string
	role  role
	tool  string // the executable it needs
	pkg   string // the Debian package that has it
	// how is the command, for the report; IMG is the qcow2 image, RAW
	// its raw twin, MNT a mount point, OUT a copy's output. note says
	// more, in words.
	how, note string
	// expose makes im (under root: the work folder or the tmpfs) readable
	// as a raw file; nil for contestants that only copy (qemu-img
	// convert).
	expose func(b *bench, im *image, root string) (*exposure, error)
	// exposeW makes a write workload's fresh image writable as a raw
	// file (writes.go); nil for contestants that do not write through a
	// file (qemu-img bench writes the image itself).
	exposeW func(b *bench, t *target) (*exposure, error)
	// howW and noteW describe exposeW for the report, when it differs.
	howW, noteW string
}

// qemuMallocTuned is the environment of the "tuned" qemu export: qemu
// allocates a bounce buffer per read, and on this kind of VM the page
// faults and munmap of buffers above glibc's default mmap threshold cost
// more than the read itself.
const qemuMallocTuned = "MALLOC_MMAP_THRESHOLD_=67108864"

var contestants = []*contestant{
	{
		id: "qcowfs", label: "qcowfs", role: subject, tool: "qcowfs",
		how:    "qcowfs mount --log-file LOG DIR MNT",
		note:   "DIR holds just the image; the file read is MNT/NAME.raw; `qcowfs unmount MNT` at the end. Default options.",
		expose: exposeQcowfs,
		howW:   "qcowfs mount --writable --log-file LOG DIR MNT",
		noteW:  "Write workloads: the same with --writable; the file written is MNT/NAME.raw.",
		exposeW: func(b *bench, t *target) (*exposure, error) {
			return mountQcowfs(b, filepath.Dir(t.img), t.name, "--writable")
		},
	},
	{
		id: "qemu", label: "qemu export", role: peer, tool: "qemu-storage-daemon", pkg: "qemu-system-common",
		how:    qemuExportHow(""),
		note:   qemuNote,
		expose: func(b *bench, im *image, root string) (*exposure, error) { return exposeQemu(b, im, root, "") },
		howW:   qemuExportHowW(""),
		noteW:  qemuNoteW,
		exposeW: func(b *bench, t *target) (*exposure, error) {
			return exposeQemuImg(b, t.img, "qemu", "", true)
		},
	},
	{
		id: "qemu-tuned", label: "qemu export, tuned", role: peer, tool: "qemu-storage-daemon", pkg: "qemu-system-common",
		how:  qemuExportHow(qemuMallocTuned),
		note: qemuNote + " glibc's mmap threshold pinned at 64 MiB: no mmap/munmap per read buffer.",
		expose: func(b *bench, im *image, root string) (*exposure, error) {
			return exposeQemu(b, im, root, qemuMallocTuned)
		},
		howW:  qemuExportHowW(qemuMallocTuned),
		noteW: qemuNoteW + " The same malloc tuning.",
		exposeW: func(b *bench, t *target) (*exposure, error) {
			return exposeQemuImg(b, t.img, "qemu-tuned", qemuMallocTuned, true)
		},
	},
	{
		id: "qcowmount", label: "qcowmount", role: peer, tool: "qcowmount", pkg: "libqcow-utils",
		how:    "qcowmount IMG MNT",
		note:   "It detaches itself; the file read is MNT/qcow1; `fusermount3 -u MNT` at the end.",
		expose: exposeQcowmount,
	},
	{
		id: "raw", label: "raw file (no FUSE)", role: baseline, tool: "dd", pkg: "coreutils",
		how:    "RAW",
		note:   "The raw twin read directly: the same bytes, no FUSE, no qcow2. The ceiling.",
		expose: exposeRaw,
		howW:   "RAW",
		noteW:  "Write workloads: a fresh raw file of the same virtual size (sparse, or fully allocated where the image is), written directly with the same O_DIRECT flags: no FUSE, no qcow2. The ceiling.",
		exposeW: func(b *bench, t *target) (*exposure, error) {
			return &exposure{file: t.img}, nil
		},
	},
	{
		id: "convert", label: "qemu-img convert", role: baseline, tool: "qemu-img", pkg: "qemu-utils",
		how:  "qemu-img convert -O raw IMG OUT",
		note: "Copy workloads only; OUT is on the same file system as the copies.",
	},
	{
		id: "qemu-img-bench", label: "qemu-img bench (no FUSE)", role: baseline, tool: "qemu-img", pkg: "qemu-utils",
		how:  "qemu-img bench -w -t none -f qcow2 ... IMG",
		note: "Write workloads only: qemu's own write path on the image file, without FUSE (the arguments are in each workload).",
	},
	// The remote workloads' contestants (remote.go): URL is the image's
	// http:// URL, through the bench's proxy.
	{
		id: "qcowfs-remote", label: "qcowfs", role: subject, tool: "qcowfs",
		how:    "qcowfs mount --log-file LOG URL MNT",
		note:   "Remote workloads: the image's URL mounted; the file read is MNT/NAME.raw. Default options (caches, connections, readahead).",
		expose: exposeQcowfsRemote,
	},
	{
		id: "qemu-http", label: "qemu export over curl", role: peer, tool: "qemu-storage-daemon", pkg: "qemu-system-common",
		how: "qemu-storage-daemon --blockdev driver=http,node-name=file0,url=URL,read-only=on " +
			"--blockdev driver=qcow2,node-name=fmt0,file=file0,read-only=on --export type=fuse,id=exp0,node-name=fmt0,mountpoint=MNT,writable=off",
		note:   "Remote workloads: qemu's curl driver (package qemu-block-extra) under its FUSE export; the curl driver's defaults (256 KiB readahead).",
		expose: exposeQemuHTTP,
	},
	{
		id: "convert-http", label: "qemu-img convert over curl", role: baseline, tool: "qemu-img", pkg: "qemu-utils",
		how:  "qemu-img convert -f qcow2 -O raw URL OUT",
		note: "Remote copy workloads: qemu's curl driver, no FUSE.",
	},
	{
		id: "curl", label: "curl (whole file)", role: baseline, tool: "curl", pkg: "curl",
		how:  "curl -sS --fail -o OUT URL",
		note: "Remote copy workloads: the naive baseline, downloading the whole qcow2 file (which then still needs converting).",
	},
	// The check workload's two contestants are commands, not mounts, like
	// qemu-img convert: measureCheck runs them on the image itself.
	{
		id: "qcowfs-check", label: "qcowfs check", role: subject, tool: "qcowfs",
		how:  "qcowfs check IMG",
		note: "Check workloads only. Exit 0: clean; like qemu-img check, 2 means corruptions and 3 leaks.",
	},
	{
		id: "qemu-img-check", label: "qemu-img check", role: peer, tool: "qemu-img", pkg: "qemu-utils",
		how:  "qemu-img check IMG",
		note: "Check workloads only; the reference qcowfs check follows (same output, same exit statuses).",
	},
}

const qemuNote = "MNT is an empty regular file; the daemon runs in the background and is stopped with SIGTERM. " +
	"read-only=on: two exports and qemu-img convert open the same image, and qemu's image locking refuses a second opener of a read-write node."

const qemuNoteW = "Write workloads: read-write nodes, writable=on; the image is opened by this daemon only. discard=unmap on both nodes: " +
	"with qemu's default (discard=ignore) fstrim and mkfs's discard are accepted and dropped, and the image gives no space back (measured: 390 MiB before and after fstrim). " +
	"Stopped with SIGTERM, which flushes and closes the image cleanly."

func qemuExportHowW(env string) string {
	s := "qemu-storage-daemon --blockdev driver=file,node-name=file0,filename=IMG,aio=threads,discard=unmap " +
		"--blockdev driver=qcow2,node-name=fmt0,file=file0,discard=unmap " +
		"--export type=fuse,id=exp0,node-name=fmt0,mountpoint=MNT,writable=on"
	if env != "" {
		s = env + " " + s
	}
	return s
}

func qemuExportHow(env string) string {
	s := "qemu-storage-daemon --blockdev driver=file,node-name=file0,filename=IMG,aio=threads,read-only=on " +
		"--blockdev driver=qcow2,node-name=fmt0,file=file0,read-only=on " +
		"--export type=fuse,id=exp0,node-name=fmt0,mountpoint=MNT,writable=off"
	if env != "" {
		s = env + " " + s
	}
	return s
}

func contestantByID(id string) *contestant {
	for _, c := range contestants {
		if c.id == id {
			return c
		}
	}
	panic("bench: no contestant " + id)
}

// An exposure is an image made readable as a file by one contestant.
type exposure struct {
	c    *contestant
	file string // the raw file to read
	mnt  string // the FUSE mount point, "" for the raw file
	pid  int    // the daemon's pid, 0 without one
	// undos tear it down, last first: the first one unmounts the
	// image; later ones undo what prepare added on top (a loop device,
	// a guest mount).
	undos []*undo
	guest string  // where the guest file system is mounted, if it is
	t     *target // the image a write workload writes (writes.go)
	// hung is set once a command on this exposure timed out: it is not
	// used again and its connection is aborted at teardown.
	hung bool
}

// peak returns the daemon's peak RSS so far, or 0 without a daemon.
func (e *exposure) peak() int64 {
	if e.pid == 0 {
		return 0
	}
	n, _ := peakRSS(e.pid)
	return n
}

// abortExposure returns a func that unblocks whatever waits on the daemon
// (a reader stuck after a timeout) by aborting the FUSE connection.
func (b *bench) abortExposure(e *exposure) func() {
	return func() {
		e.hung = true
		if e.mnt != "" {
			if err := b.abortFUSE(e.mnt); err != nil {
				fmt.Fprintf(b.log, "abort %s: %v\n", e.mnt, err)
			}
		}
	}
}

// abortHung aborts the FUSE connection of an exposure whose command timed
// out, before what was built on it (a guest mount, a loop device) is torn
// down: unmounting a guest file system waits for the reads still queued on
// the daemon, which a slow one (qemu's export over curl) answers for
// minutes, where an aborted connection fails them at once.
func (b *bench) abortHung(e *exposure) {
	if !e.hung || e.mnt == "" {
		return
	}
	if err := b.abortFUSE(e.mnt); err != nil {
		fmt.Fprintf(b.log, "abort %s: %v\n", e.mnt, err)
	}
}

// mountDir makes a fresh, empty folder (or, with file, an empty regular
// file: qemu's FUSE export mounts on a file) for a mount point.
func (b *bench) mountDir(id string, file bool) (string, error) {
	b.mu.Lock()
	b.seq++
	p := filepath.Join(b.cfg.work, "mnt", fmt.Sprintf("%03d-%s", b.seq, id))
	b.mu.Unlock()
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return "", err
	}
	if file {
		return p + ".raw", os.WriteFile(p+".raw", nil, 0o644)
	}
	return p, os.Mkdir(p, 0o755)
}

func (b *bench) logPath(name string) string {
	return filepath.Join(b.cfg.work, "logs", name+".log")
}

// checkExposed checks that the exposed file has the image's size. It
// stats through a command with a timeout: a daemon that hangs on its
// first request must not hang the bench.
func (b *bench) checkExposed(e *exposure, size int64) error {
	out, err := b.must(&cmd{name: "stat", args: []string{"-L", "-c", "%s", e.file}, timeout: 30 * time.Second, stuck: b.abortExposure(e)})
	if err != nil {
		return err
	}
	got, err := strconv.ParseInt(strings.TrimSpace(out), 10, 64)
	if err != nil || got != size {
		return fmt.Errorf("%s has %q bytes, want %d", e.file, strings.TrimSpace(out), size)
	}
	return nil
}

func exposeQcowfs(b *bench, im *image, root string) (*exposure, error) {
	return mountQcowfs(b, filepath.Join(root, "img", im.name), im.name)
}

// mountQcowfs mounts the folder src, which holds the image name, with the
// extra flags.
func mountQcowfs(b *bench, src, name string, flags ...string) (*exposure, error) {
	mnt, err := b.mountDir("qcowfs", false)
	if err != nil {
		return nil, err
	}
	e := &exposure{mnt: mnt, file: filepath.Join(mnt, name+".raw")}
	log := b.logPath(filepath.Base(mnt))
	exe, args := b.daemonCommand(b.cfg.bin, append(append([]string{"mount"}, flags...), "--log-file", log, src, mnt))
	c := &cmd{name: exe, args: args, timeout: time.Minute}
	if len(b.underStrace) > 0 {
		// The detached tracer holds what the mount command's output
		// goes to.
		c.outFile = log + ".mount"
	}
	_, err = b.must(c)
	if err != nil {
		b.forceUnmount(mnt)
		os.Remove(mnt)
		return nil, err
	}
	e.pid = findDaemon(filepath.Base(b.cfg.bin), mnt)
	down := b.push("unmount qcowfs "+mnt, func() error {
		var errs []error
		if !e.hung {
			if _, err := b.must(&cmd{name: b.cfg.bin, args: []string{"unmount", mnt}, timeout: 30 * time.Second, cleanup: true}); err != nil {
				errs = append(errs, err)
			}
		}
		errs = append(errs, b.forceUnmount(mnt), b.reap(e.pid, "qcowfs"))
		os.Remove(mnt)
		return errors.Join(errs...)
	})
	e.undos = []*undo{down}
	return e, nil
}

// reap waits for a daemon to exit after its unmount, and kills it if it
// does not.
func (b *bench) reap(pid int, what string) error {
	if pid == 0 || waitGone(pid, 10*time.Second) {
		return nil
	}
	syscall.Kill(pid, syscall.SIGKILL)
	if waitGone(pid, 5*time.Second) {
		return fmt.Errorf("%s daemon %d did not exit after its unmount; killed", what, pid)
	}
	return fmt.Errorf("%s daemon %d survives SIGKILL", what, pid)
}

func exposeQemu(b *bench, im *image, root, env string) (*exposure, error) {
	id := "qemu"
	if env != "" {
		id = "qemu-tuned"
	}
	return exposeQemuImg(b, filepath.Join(root, "img", im.name, im.name+".qcow2"), id, env, false)
}

// exposeQemuImg exports img with qemu-storage-daemon, read-only or
// writable.
func exposeQemuImg(b *bench, img, id, env string, writable bool) (*exposure, error) {
	node := "driver=file,node-name=file0,filename=" + img + ",aio=threads,read-only=on"
	if writable {
		node = "driver=file,node-name=file0,filename=" + img + ",aio=threads,discard=unmap"
	}
	return exposeQemuNode(b, id, env, node, writable)
}

// exposeQemuNode exports a qcow2 node over the protocol node fileNode
// (named file0: a local file, or an HTTP URL).
func exposeQemuNode(b *bench, id, env, fileNode string, writable bool) (*exposure, error) {
	file, err := b.mountDir(id, true)
	if err != nil {
		return nil, err
	}
	// read-only=on: during a read workload the same image is open in two
	// exports (default and tuned) and in qemu-img convert; a read-write
	// node would take qemu's exclusive write lock and the second opener
	// would fail. The export is read-only anyway (writable=off). A write
	// workload's image is this daemon's alone.
	args := []string{
		"--blockdev", fileNode,
		"--blockdev", "driver=qcow2,node-name=fmt0,file=file0,read-only=on",
		"--export", "type=fuse,id=exp0,node-name=fmt0,mountpoint=" + file + ",writable=off",
	}
	if writable {
		args = []string{
			"--blockdev", fileNode,
			"--blockdev", "driver=qcow2,node-name=fmt0,file=file0,discard=unmap",
			"--export", "type=fuse,id=exp0,node-name=fmt0,mountpoint=" + file + ",writable=on",
		}
	}
	logf, err := os.Create(b.logPath(filepath.Base(file)))
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	name, args := b.daemonCommand("qemu-storage-daemon", args)
	pc := exec.Command(name, args...)
	if env != "" {
		pc.Env = append(os.Environ(), env)
	}
	pc.Stdout, pc.Stderr = logf, logf
	// Its own process group: the terminal's Ctrl-C must not kill it
	// before the bench unmounts it.
	pc.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	fmt.Fprintf(b.log, "%s $ %s &\n", time.Now().Format("15:04:05.000"), shellQuote(append([]string{env, name}, args...)))
	if err := pc.Start(); err != nil {
		os.Remove(file)
		return nil, err
	}
	exited := make(chan struct{})
	var once sync.Once
	go func() { pc.Wait(); once.Do(func() { close(exited) }) }()

	e := &exposure{file: file, mnt: file, pid: pc.Process.Pid}
	down := b.push("stop qemu-storage-daemon "+file, func() error {
		var errs []error
		if e.hung {
			// Timed out: its connection is aborted already
			// (abortHung), and a daemon still waiting on curl
			// ignores SIGTERM.
			pc.Process.Kill()
		} else {
			pc.Process.Signal(syscall.SIGTERM)
		}
		select {
		case <-exited:
		case <-time.After(15 * time.Second):
			errs = append(errs, fmt.Errorf("qemu-storage-daemon %d ignored SIGTERM for 15 s; killed", e.pid))
			b.abortFUSE(file)
			pc.Process.Kill()
			<-exited
		}
		errs = append(errs, b.forceUnmount(file))
		os.Remove(file)
		return errors.Join(errs...)
	})
	e.undos = []*undo{down}
	live := b.waitUntil(b.ctx, 30*time.Second, func() bool {
		select {
		case <-exited:
			return true
		default:
		}
		return isMounted(file)
	})
	select {
	case <-exited:
		b.undo(down)
		logText, _ := os.ReadFile(logf.Name())
		return nil, fmt.Errorf("qemu-storage-daemon exited: %s", lastLines(string(logText), 3))
	default:
	}
	if !live {
		b.undo(down)
		return nil, fmt.Errorf("qemu-storage-daemon: %s not mounted after 30 s", file)
	}
	return e, nil
}

func exposeQcowmount(b *bench, im *image, root string) (*exposure, error) {
	mnt, err := b.mountDir("qcowmount", false)
	if err != nil {
		return nil, err
	}
	img := filepath.Join(root, "img", im.name, im.name+".qcow2")
	e := &exposure{mnt: mnt, file: filepath.Join(mnt, "qcow1")}
	// qcowmount detaches itself and returns before the mount is live.
	if _, err := b.must(&cmd{name: "qcowmount", args: []string{img, mnt}, timeout: time.Minute}); err != nil {
		b.forceUnmount(mnt)
		os.Remove(mnt)
		return nil, err
	}
	live := b.waitUntil(b.ctx, 30*time.Second, func() bool { return isMounted(mnt) })
	e.pid = findDaemon("qcowmount", mnt)
	down := b.push("unmount qcowmount "+mnt, func() error {
		var errs []error
		if !e.hung && isMounted(mnt) {
			if _, err := b.must(&cmd{name: "fusermount3", args: []string{"-u", mnt}, timeout: 30 * time.Second, cleanup: true}); err != nil {
				errs = append(errs, err)
			}
		}
		errs = append(errs, b.forceUnmount(mnt), b.reap(e.pid, "qcowmount"))
		os.Remove(mnt)
		return errors.Join(errs...)
	})
	e.undos = []*undo{down}
	if !live {
		b.undo(down)
		return nil, fmt.Errorf("qcowmount: %s not mounted after 30 s", mnt)
	}
	return e, nil
}

func exposeRaw(b *bench, im *image, root string) (*exposure, error) {
	e := &exposure{file: filepath.Join(root, "raw", im.raw+".raw")}
	return e, nil
}

// An undo is one step of tearing down, registered as soon as there is
// something to tear down, so that an error or an interrupt anywhere later
// still runs it.
type undo struct {
	name string
	fn   func() error
	done bool
}

// push registers fn to be run by undo or, at the latest, when the bench
// ends (last registered first).
func (b *bench) push(name string, fn func() error) *undo {
	u := &undo{name: name, fn: fn}
	b.mu.Lock()
	b.undos = append(b.undos, u)
	b.mu.Unlock()
	return u
}

// undo runs u now, once.
func (b *bench) undo(u *undo) error {
	b.mu.Lock()
	if u == nil || u.done {
		b.mu.Unlock()
		return nil
	}
	u.done = true
	b.mu.Unlock()
	err := u.fn()
	if err != nil {
		b.warn("%s: %v", u.name, err)
	}
	return err
}

// undoAll runs every undo not run yet, last registered first.
func (b *bench) undoAll() {
	b.mu.Lock()
	us := b.undos
	b.undos = nil
	b.mu.Unlock()
	for i := len(us) - 1; i >= 0; i-- {
		b.undo(us[i])
	}
}
