package main

import (
	"fmt"
	"log"
	"os"
	"os/signal"
	"runtime/debug"
	"runtime/pprof"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/fs"
	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/remote"
)

// serve mounts and serves until unmounted. ready, if not nil, is the pipe
// to the waiting parent (see daemon.go).
func (c *mountCmd) serve(ready *os.File) (err error) {
	say := func(format string, args ...any) {
		if ready != nil {
			fmt.Fprintf(ready, readySay+format+"\n", args...)
		}
	}
	defer func() {
		if err != nil {
			err = reportFailure(ready, err)
		}
	}()
	started := time.Now()

	dest, err := c.logDestination(ready != nil)
	if err != nil {
		return err
	}
	logger, err := c.newLogger(dest.out)
	if err != nil {
		return err
	}
	if ready != nil {
		// Do not keep the caller's working folder busy. Every path
		// is absolute by now (resolvePaths).
		os.Chdir("/")
	}
	cfg := fs.Config{
		Source:       c.Source,
		Image:        c.imageOptions(),
		Log:          logger,
		ForceShare:   c.ForceShare,
		NoPartitions: c.NoPartitions,
		Writable:     c.Writable,
		Overlay:      c.Overlay,
		Hint:         c.refusalHint,
		TestHook:     testHook(),
	}
	if remote.IsURL(c.Source) {
		client, err := c.client(logger)
		if err != nil {
			return err
		}
		defer client.Close()
		cfg.Remote, cfg.RemoteRefresh = client, c.RemoteRefresh
		_, cfg.AllowBackingURLs = splitAllowed(c.AllowBackingOutside)
	}
	cfg.Image.Cache = qcow2.NewCache(int64(c.L2CacheSize), int64(c.CacheSize))
	cfg.Image.Budget = qcow2.NewBudget(int64(c.MetadataMemory))
	if os.Getenv("GOMEMLIMIT") == "" {
		stop := c.limitMemory(cfg.Image.Budget, cfg.Remote != nil)
		defer stop()
	}
	if c.ReadPath == "copy" {
		cfg.ReadPath = fs.ReadCopy
	}
	cfg.WritebackCache = c.Writable && !c.NoWritebackCache
	root, err := fs.NewRoot(cfg)
	if err != nil {
		return err
	}
	opts := fs.Options(cfg)
	opts.AllowOther = c.AllowOther
	opts.Debug = c.Debug
	opts.Logger = log.New(dest.out, "", log.LstdFlags)
	opts.MountOptions.Logger = opts.Logger
	opts.FsName = shownSource(c.Source)
	if c.FSName != "" {
		opts.FsName = c.FSName
	}
	// Catch signals before mounting: one arriving between the mount and
	// signal.Notify would kill the process and leave a dead mount behind.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	signal.Ignore(syscall.SIGPIPE)
	defer signal.Stop(sigs)
	defer signal.Stop(hup)
	if c.CPUProfile != "" {
		f, err := os.Create(c.CPUProfile)
		if err != nil {
			return fmt.Errorf("cpu profile: %w", err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			return fmt.Errorf("cpu profile: %w", err)
		}
		defer func() {
			pprof.StopCPUProfile()
			f.Close()
		}()
	}
	// Before this mount is made, so that it does not find itself.
	shared := c.sharedWriters()
	server, err := c.mount(root, opts)
	if err != nil {
		return err
	}
	root.KernelFlags(server.KernelSettings().Flags64())
	if os.Geteuid() == 0 && c.ReadAhead > 0 {
		if err := fs.SetReadAhead(c.Mountpoint, int(c.ReadAhead>>10)); err != nil {
			logger.Warn("cannot raise the kernel readahead; sequential reads will be slower", "err", err)
		}
	}
	logger.Info("mounted", "source", shownSource(c.Source), "mountpoint", c.Mountpoint, "pid", os.Getpid(), "log", dest.where)
	for _, line := range shared {
		logger.Warn(line)
		say("warning: %s", line)
	}

	// The images the first scan refused, and the tree's counters.
	var refused refusalLister = root
	var stats func() any
	if ss, ok := any(root).(statsSource); ok {
		stats = ss.Stats
	}
	// The tree logs each refusal itself; these lines are for the user.
	for _, line := range refusalLines(refused, c.refusalHint) {
		say("%s", line)
	}
	facts := mountFacts{Source: shownSource(c.Source), Mountpoint: c.Mountpoint, PID: os.Getpid(), Started: started, Log: dest.where,
		Writable: c.Writable, Overlay: c.Overlay, Hint: c.refusalHint}
	if c.Writable {
		facts.CacheMode = "writethrough"
		if cfg.WritebackCache {
			facts.CacheMode = "writeback"
		}
	}
	stopControl, err := startControl(c.Mountpoint, func() any { return facts.status(refused, stats) }, logger)
	if err != nil {
		logger.Warn("no control socket; qcowfs status will not answer", "err", err)
	}
	if dest.fallback {
		say("no syslog (/dev/log): the log is in %s", dest.where)
	}
	if ready != nil {
		fmt.Fprintln(ready, readyOK)
		ready.Close()
		if dest.file == nil {
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
		for range hup {
			if dest.file == nil {
				continue
			}
			if err := dest.file.Reopen(); err != nil {
				logger.Error("reopening the log file", "err", err)
			} else {
				logger.Info("log file reopened", "path", dest.where)
			}
		}
	}()
	go func() {
		for s := range sigs {
			logger.Info("unmounting", "signal", s.String())
			if err := server.Unmount(); err != nil {
				// Busy: detach now; the kernel ends the session
				// when the last user lets go, and Wait returns.
				logger.Warn("mount busy; detaching it lazily", "err", err)
				if err := unmount(c.Mountpoint, true); err != nil {
					logger.Error("lazy unmount failed", "err", err)
				}
			}
		}
	}()
	server.Wait()
	// Whatever is still open (a lazy unmount, a daemon told to stop) is
	// written back and closed.
	root.Close()
	if stopControl != nil {
		stopControl()
	}
	logger.Info("unmounted", "mountpoint", c.Mountpoint)
	return nil
}

// mount makes the FUSE mount. As non-root, go-fuse runs fusermount3,
// which says why it failed on its stderr; that text becomes the error, in
// the foreground as in the daemon (whose stderr is /dev/null).
func (c *mountCmd) mount(root *fs.Root, opts *gofs.Options) (*fuse.Server, error) {
	var restore func() string
	if os.Geteuid() != 0 {
		restore, _ = captureStderr()
	}
	server, err := fs.Mount(c.Mountpoint, root, opts)
	if restore != nil {
		said := oneLine(restore())
		if err != nil && said != "" {
			return nil, fmt.Errorf("mounting on %s: %s", c.Mountpoint, said)
		}
		if said != "" {
			fmt.Fprintln(os.Stderr, said)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("mounting on %s: %s", c.Mountpoint, oneLine(err.Error()))
	}
	return server, nil
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
