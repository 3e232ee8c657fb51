package main

import (
	"fmt"
	"log"
	"log/slog"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"strings"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/fs"
	"github.com/qcowfs/qcowfs/internal/remotefile"
	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/remote"
)

// serve mounts and serves until unmounted. ready, if not nil, is the pipe
// to the waiting parent (see daemon.go). Its steps, each a method of a
// session: the log (setupLog), the tree and its FUSE mount (mount),
// serving until the mount goes (serve), and the shutdown.
func (c *mountCmd) serve(ready *os.File) (err error) {
	s := &session{cmd: c, ready: ready, started: time.Now()}
	defer func() {
		s.release()
		if err != nil {
			err = reportFailure(ready, err)
		}
	}()
	if err := s.setupLog(); err != nil {
		return err
	}
	if err := s.mount(); err != nil {
		return err
	}
	s.serve()
	s.shutdown()
	return nil
}

// A session is one mount from its log's opening to its unmount: what
// serve's steps hand on to the next.
type session struct {
	cmd     *mountCmd
	ready   *os.File // the pipe to the waiting parent; nil in the foreground
	started time.Time

	dest *logDest // setupLog
	log  *slog.Logger

	cfg       fs.Config // mount
	root      *fs.Root
	server    *fuse.Server
	ring      *ringChoice // the FUSE-over-io_uring rings, if any (uring.go)
	sigs, hup chan os.Signal

	stopControl func() // serve; nil without a control socket

	tempOverlays string // --overlay=temp: the folder of this daemon's overlays

	// undo is what serve releases when it returns, last first: the
	// remote client, the memory limit, the signal handlers, the CPU
	// profile.
	undo []func()
}

// say tells the waiting parent a line for the user's stderr.
func (s *session) say(format string, args ...any) {
	if s.ready != nil {
		fmt.Fprintf(s.ready, readySay+format+"\n", args...)
	}
}

// atEnd has f run when serve returns.
func (s *session) atEnd(f func()) { s.undo = append(s.undo, f) }

func (s *session) release() {
	for i := len(s.undo) - 1; i >= 0; i-- {
		s.undo[i]()
	}
}

// setupLog opens the log (logDestination) and its logger. A daemon then
// leaves the caller's working folder, so as not to keep it busy: every
// path is absolute by now (resolvePaths).
func (s *session) setupLog() error {
	dest, err := s.cmd.logDestination(s.ready != nil)
	if err != nil {
		return err
	}
	logger, err := s.cmd.newLogger(dest.out)
	if err != nil {
		return err
	}
	s.dest, s.log = dest, logger
	if s.ready != nil {
		os.Chdir("/")
	}
	return nil
}

// newRoot makes the tree's configuration from the flags, with what it
// needs until the end (the remote client, the memory limit), and its root
// node.
func (s *session) newRoot() error {
	c := s.cmd
	if c.keys != nil {
		c.keys.OnWarning(func(format string, args ...any) { s.log.Warn(fmt.Sprintf(format, args...)) })
	}
	cfg := fs.Config{
		Source:        c.Source,
		Image:         c.imageOptions(),
		Log:           s.log,
		ForceShare:    c.ForceShare,
		NoPartitions:  c.NoPartitions,
		NoBitmapViews: c.NoBitmapViews,
		Writable:      c.Writable,
		Overlay:       c.Overlay,
		Hint:          c.refusalHint,
		TestHook:      testHook(),

		AcceptChangedBase: c.AcceptChangedBase,
		Hydrate:           c.Hydrate.On,
	}
	if c.Overlay == tempOverlay {
		dir, err := makeTempOverlayDir()
		if err != nil {
			return err
		}
		// After the images are closed (shutdown), or if the mount
		// fails.
		s.atEnd(func() {
			if err := os.RemoveAll(dir); err != nil {
				s.log.Error("removing the throwaway overlays", "folder", dir, "err", err)
			}
		})
		cfg.Overlay, s.tempOverlays = dir, dir
		if !c.keys.Empty() {
			c.keys.AddRoot(dir) // overlays have their originals' passphrases
		}
	}
	if remote.IsURL(c.Source) {
		c.hydrateRate = int64(c.Hydrate.Rate)
		client, err := c.client(s.log)
		if err != nil {
			return err
		}
		s.atEnd(func() { client.Close() })
		if c.Foreground && c.Hydrate.On && isTerminal(os.Stderr) {
			s.atEnd(showHydration(os.Stderr, client.Hydrations))
		}
		cfg.Remote, cfg.RemoteRefresh = client, c.RemoteRefresh
		_, cfg.AllowBackingURLs = splitAllowed(c.AllowBackingOutside)
	}
	cfg.Image.Cache = qcow2.NewCache(int64(c.L2CacheSize), int64(c.CacheSize))
	cfg.Image.Cache.WhenInflating(spareProcs)
	cfg.Image.Budget = qcow2.NewBudget(int64(c.MetadataMemory))
	if os.Getenv("GOMEMLIMIT") == "" {
		s.atEnd(c.limitMemory(cfg.Image.Budget, cfg.Remote != nil))
	}
	if c.ReadPath == "copy" {
		cfg.ReadPath = fs.ReadCopy
	}
	cfg.WritebackCache = c.Writable && !c.NoWritebackCache
	root, err := fs.NewRoot(cfg)
	if err != nil {
		return err
	}
	s.cfg, s.root = cfg, root
	return nil
}

// mount makes the root node and mounts it, with the signals caught first
// and the CPU profile started; it logs the mount, and warns of other
// writable mounts of the same source.
func (s *session) mount() error {
	if err := s.newRoot(); err != nil {
		return err
	}
	c := s.cmd
	opts := fs.Options(s.cfg)
	opts.AllowOther = c.AllowOther
	opts.Debug = c.Debug
	opts.Logger = log.New(s.dest.out, "", log.LstdFlags)
	opts.MountOptions.Logger = opts.Logger
	opts.FsName = shownSource(c.Source)
	if c.FSName != "" {
		opts.FsName = c.FSName
	}
	// Catch signals before mounting: one arriving between the mount and
	// signal.Notify would kill the process and leave a dead mount behind.
	s.sigs = make(chan os.Signal, 1)
	signal.Notify(s.sigs, syscall.SIGINT, syscall.SIGTERM)
	s.hup = make(chan os.Signal, 1)
	signal.Notify(s.hup, syscall.SIGHUP)
	signal.Ignore(syscall.SIGPIPE)
	s.atEnd(func() { signal.Stop(s.sigs) })
	s.atEnd(func() { signal.Stop(s.hup) })
	if c.CPUProfile != "" {
		f, err := os.Create(c.CPUProfile)
		if err != nil {
			return fmt.Errorf("cpu profile: %w", err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			return fmt.Errorf("cpu profile: %w", err)
		}
		s.atEnd(func() {
			pprof.StopCPUProfile()
			f.Close()
		})
	}
	if c.singleImage() {
		// The first scan, before mounting: a single image the mount
		// would not show fails it (preflight's checks of the image
		// do not open its overlay, which may be refused too).
		if err := s.singleRefused(); err != nil {
			return err
		}
	}
	// Before this mount is made, so that it does not find itself.
	shared := c.sharedWriters()
	server, ring, err := c.mountFUSE(s.root, opts, s.log)
	if err != nil {
		return err
	}
	s.server, s.ring = server, ring
	ring.report()
	s.root.KernelFlags(server.KernelSettings().Flags64())
	if os.Geteuid() == 0 && c.ReadAhead > 0 {
		if err := fs.SetReadAhead(c.Mountpoint, int(c.ReadAhead>>10)); err != nil {
			s.log.Warn("cannot raise the kernel readahead; sequential reads will be slower", "err", err)
		}
	}
	s.log.Info("mounted", "source", shownSource(c.Source), "mountpoint", c.Mountpoint, "pid", os.Getpid(), "log", s.dest.where)
	for _, line := range shared {
		s.log.Warn(line)
		s.say("warning: %s", line)
	}
	return nil
}

// singleImage reports whether the source is one image (a file, or the
// URL of one object), not a folder or a prefix.
func (c *mountCmd) singleImage() bool {
	if remote.IsURL(c.Source) {
		return !remotefile.IsPrefix(c.Source)
	}
	st, err := os.Stat(c.Source)
	return err == nil && st.Mode().IsRegular()
}

// singleRefused scans a single image's mount and returns why the image
// is not shown, or nil.
func (s *session) singleRefused() error {
	for path, err := range s.root.Refused() {
		err = hintWith(err, s.cmd.refusalHint(err))
		if !strings.Contains(err.Error(), path) {
			return fmt.Errorf("source %s: %w", path, err)
		}
		return fmt.Errorf("source: %w", err)
	}
	return nil
}

// serve tells the user which images are not shown, answers on the control
// socket, tells the waiting parent that the mount is live, and serves
// until the mount goes: unmounted, or on SIGINT or SIGTERM, which unmount
// it (lazily if busy). SIGHUP reopens the log file.
func (s *session) serve() {
	c := s.cmd
	// The images the first scan refused, and the tree's counters.
	var refused refusalLister = s.root
	var stats func() any
	if ss, ok := any(s.root).(statsSource); ok {
		stats = ss.Stats
	}
	// The tree logs each refusal itself; these lines are for the user.
	for _, line := range refusalLines(refused, c.refusalHint) {
		s.say("%s", line)
	}
	var readOnly readOnlyLister = s.root
	for _, line := range readOnlyLines(readOnly) {
		s.say("%s", line)
	}
	if n, none := s.root.NoImages(); none {
		line := fmt.Sprintf("%s: no qcow2 images among the %s listed (only objects that begin with the qcow2 magic are shown); the mount is empty", shownSource(c.Source), plural(n, "object"))
		s.log.Warn(line)
		s.say("%s", line)
	}
	facts := mountFacts{Source: shownSource(c.Source), Mountpoint: c.Mountpoint, PID: os.Getpid(), Started: s.started, Log: s.dest.where,
		Writable: c.Writable, Overlay: s.cfg.Overlay, TempOverlay: s.tempOverlays != "", Hint: c.refusalHint,
		Offline: c.Offline, CacheDir: c.CacheDir, Transport: s.ring.name()}
	if c.Writable {
		facts.CacheMode = "writethrough"
		if s.cfg.WritebackCache {
			facts.CacheMode = "writeback"
		}
	}
	stopControl, err := startControl(c.Mountpoint, func() any { return facts.status(refused, readOnly, stats) }, s.log)
	if err != nil {
		s.log.Warn("no control socket; qcowfs status will not answer", "err", err)
	}
	s.stopControl = stopControl
	if s.dest.fallback {
		s.say("no syslog (/dev/log): the log is in %s", s.dest.where)
	}
	if s.ready != nil {
		fmt.Fprintln(s.ready, readyOK)
		s.ready.Close()
		if s.dest.file == nil {
			// Nothing should write to fd 2 any more; a Go panic
			// would, and the log file, when there is one,
			// took it over.
			if null, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0); err == nil {
				unix.Dup3(int(null.Fd()), 2, 0)
				null.Close()
			}
		}
	}

	go func() {
		for range s.hup {
			if s.dest.file == nil {
				continue
			}
			if err := s.dest.file.Reopen(); err != nil {
				s.log.Error("reopening the log file", "err", err)
			} else {
				s.log.Info("log file reopened", "path", s.dest.where)
			}
		}
	}()
	go func() {
		for sig := range s.sigs {
			s.log.Info("unmounting", "signal", sig.String())
			if err := s.server.Unmount(); err != nil {
				// Busy: detach now; the kernel ends the session
				// when the last user lets go, and Wait returns.
				s.log.Warn("mount busy; detaching it lazily", "err", err)
				if err := unmount(c.Mountpoint, true); err != nil {
					s.log.Error("lazy unmount failed", "err", err)
				}
			}
		}
	}()
	s.server.Wait()
	// The rings' requests too, before shutdown closes the images.
	s.ring.wait()
}

// shutdown writes back and closes whatever is still open (after a lazy
// unmount, or a daemon told to stop), and stops answering on the control
// socket.
func (s *session) shutdown() {
	s.root.Close()
	if s.stopControl != nil {
		s.stopControl()
	}
	s.log.Info("unmounted", "mountpoint", s.cmd.Mountpoint)
}

// mountFUSE makes the FUSE mount. As non-root, go-fuse runs fusermount3,
// which says why it failed on its stderr; that text becomes the error, in
// the foreground as in the daemon (whose stderr is /dev/null).
func (c *mountCmd) mountFUSE(root *fs.Root, opts *gofs.Options, log *slog.Logger) (*fuse.Server, *ringChoice, error) {
	ring, err := c.newRing(opts, log)
	if err != nil {
		return nil, nil, err
	}
	var restore func() string
	if os.Geteuid() != 0 {
		restore, _ = captureStderr()
	}
	server, err := fs.Mount(c.Mountpoint, root, opts, ring.afterInit(root))
	if restore != nil {
		said := oneLine(restore())
		if err != nil && said != "" {
			return nil, nil, fmt.Errorf("mounting on %s: %s", c.Mountpoint, said)
		}
		if said != "" {
			fmt.Fprintln(os.Stderr, said)
		}
	}
	if err != nil {
		return nil, nil, fmt.Errorf("mounting on %s: %s", c.Mountpoint, oneLine(err.Error()))
	}
	return server, ring, nil
}

// spareProcs gives the daemon twice as many Ps as it has (the CPUs it may
// use), unless GOMAXPROCS is set; it runs once, when the mount first
// inflates a compressed cluster. Go counts a goroutine in a cgo call or a
// blocking system call as holding its P until the runtime's monitor takes
// the P back, 20 µs later at the earliest and, measured here, 100 µs or
// more under load. Inflating a cluster is a cgo call of 20-60 µs (libzstd,
// libdeflate), and go-fuse's readers wait in read(2) on /dev/fuse: with
// one P per CPU, 4 KiB random reads of a zstd image left 10.7 % of the
// machine idle while requests waited for a P; with twice the Ps 5.3 %, and
// 12 % more reads a second. Mounts that never inflate keep one P per CPU:
// there the extra Ps bought nothing but threads spinning for work, 1.5 µs
// more CPU per 4 KiB read (docs/benchmarks.md).
func spareProcs() {
	if os.Getenv("GOMAXPROCS") == "" {
		runtime.GOMAXPROCS(2 * runtime.GOMAXPROCS(0))
	}
}

// memoryHeadroom is what the daemon needs beside its caches: go-fuse's
// request buffers (1 MiB each, one per request in flight and per reader),
// the writes in flight behind the writer (8 MiB), the runtime.
const memoryHeadroom = 128 << 20

// limitMemory keeps the Go runtime's soft memory limit at the daemon's
// configured caches, the metadata its open images hold (budget) and
// memoryHeadroom, and returns what stops it. Without a limit the heap
// may grow well past them before the collector runs: under 4 KiB O_DIRECT
// writes at 70k a second, go-fuse's pooled request buffers are dropped
// and reallocated faster than the default pacing (the next collection at
// twice the live heap) frees them, and the daemon's RSS grew past 570 MiB
// in 30 seconds; with the limit it stays below it (docs/benchmarks.md).
// GOMEMLIMIT, if set, wins.
func (c *mountCmd) limitMemory(budget *qcow2.Budget, remote bool) (stop func()) {
	base := int64(c.L2CacheSize) + int64(c.CacheSize) + memoryHeadroom
	if remote {
		base += int64(c.RemoteCacheSize)
	}
	set := func() { debug.SetMemoryLimit(base + budget.Used()) }
	set()
	done := make(chan struct{})
	go func() {
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				set()
			case <-done:
				return
			}
		}
	}()
	return func() { close(done) }
}
