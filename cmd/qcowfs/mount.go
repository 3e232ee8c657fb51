package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"log/syslog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"

	"github.com/qcowfs/qcowfs/fs"
	"github.com/qcowfs/qcowfs/qcow2"
)

type mountCmd struct {
	Source              string   `arg:"" help:"Folder of qcow2 images (searched recursively), or one image file."`
	Mountpoint          string   `arg:"" help:"Folder to mount on."`
	Foreground          bool     `short:"f" help:"Stay in the foreground and log to stderr; unmount on SIGINT or SIGTERM."`
	AllowOther          bool     `help:"Let other users read the mount (as non-root this needs user_allow_other in /etc/fuse.conf). File permissions still apply."`
	L2CacheSize         byteSize `name:"l2-cache-size" default:"32M" placeholder:"SIZE" help:"Memory for L2 tables, shared by all images: 32M maps 256 GiB of disk at 64 KiB clusters."`
	CacheSize           byteSize `default:"64M" placeholder:"SIZE" help:"Memory for decompressed clusters of compressed images, shared by all images."`
	MetadataMemory      byteSize `default:"512M" placeholder:"SIZE" help:"Memory for the metadata images keep while open (L1, snapshot and refcount tables, metadata maps), shared by all images; an image that does not fit is not served."`
	LogLevel            string   `enum:"debug,info,warn,error" default:"info" help:"Least severe log messages to keep: debug, info, warn or error."`
	LogFile             string   `placeholder:"PATH" help:"Append the log here. Default: syslog when running as a daemon, stderr with --foreground."`
	Debug               bool     `help:"Log every FUSE request and reply (very verbose)."`
	ReadAhead           byteSize `default:"4M" placeholder:"SIZE" help:"Kernel readahead for the mount (root only; the kernel's FUSE default is 128K)."`
	ReadPath            string   `enum:"splice,copy" default:"splice" help:"How reads of uncompressed data are answered: splice (zero-copy from the image file) or copy (through a buffer)."`
	CPUProfile          string   `placeholder:"PATH" help:"Write a Go CPU profile of the daemon here, from mount to unmount."`
	AllowBackingOutside []string `placeholder:"DIR" help:"Also follow backing and data files that resolve inside DIR (repeatable). By default they must lie inside the source folder."`
	AllowCorrupt        bool     `help:"Serve images qemu marked corrupt (read-only, with a warning in the log)."`
	NoPartitions        bool     `help:"Do not show the folders of guest partitions (STEM.raw.parts/p1, ...)."`
	ForceShare          bool     `short:"U" help:"Serve images that another process (a running qemu) has open for writing, like qemu-img -U; their content may change under the reader."`
	Options             []string `short:"o" sep:"," placeholder:"OPT" help:"Options in mount(8) style: ro, allow_other, l2_cache_size=SIZE, cache_size=SIZE, metadata_memory=SIZE, read_ahead=SIZE, read_path=splice|copy, force_share, allow_corrupt, allow_backing_outside=DIR, no_partitions, log_level=LEVEL, log_file=PATH, debug, foreground. Generic ones (rw, dev, suid, exec, auto, noauto, user, nofail, _netdev, x-*, ...) are accepted and ignored."`
	// Fake is mount(8)'s -f passed to a mount.qcowfs helper: check the
	// options, mount nothing.
	Fake bool `hidden:"" help:"Check the options but mount nothing (mount -f)."`
}

// daemonEnv marks the re-executed daemon; fd 3 is then the pipe on which it
// reports to the waiting parent.
const daemonEnv = "QCOWFS_DAEMON"

// Run mounts. Without --foreground the mount is served by a re-executed
// copy of this program in its own session; this process waits until the
// mount is live (or failed) and exits with that result.
func (c *mountCmd) Run() error {
	var ready *os.File
	if os.Getenv(daemonEnv) != "" {
		os.Unsetenv(daemonEnv)
		ready = os.NewFile(3, "ready")
	}
	if err := c.applyOptions(); err != nil {
		return reportFailure(ready, err)
	}
	if c.Fake {
		return nil
	}
	// The daemon checks again: things may have changed since the parent
	// did, and its reason must reach the parent, not /dev/null.
	if err := c.preflight(); err != nil {
		return reportFailure(ready, err)
	}
	if c.Foreground {
		return c.serve(nil)
	}
	if ready != nil {
		return c.serve(ready)
	}
	return c.daemonize()
}

// reportFailure sends err to the waiting parent if this is the daemon
// (ready is not nil) and returns what the daemon exits with; otherwise it
// returns err.
func reportFailure(ready *os.File, err error) error {
	if ready == nil {
		return err
	}
	fmt.Fprintf(ready, "error: %v\n", err)
	ready.Close()
	return &exitError{code: 1}
}

// applyOptions folds -o options into the flags.
func (c *mountCmd) applyOptions() error {
	for _, o := range c.Options {
		key, val, hasVal := strings.Cut(strings.TrimSpace(o), "=")
		switch key {
		case "", "ro", "rw", "defaults", "dev", "nodev", "suid", "nosuid", "exec", "noexec",
			"auto", "noauto", "user", "nouser", "users", "owner", "group", "nofail", "_netdev",
			"atime", "noatime", "relatime", "norelatime", "strictatime", "nodiratime", "diratime",
			"sync", "async", "default_permissions", "comment":
			// Generic options; the mount is read-only whatever they say.
		case "allow_other":
			c.AllowOther = true
		case "debug":
			c.Debug = true
		case "force_share":
			c.ForceShare = true
		case "allow_corrupt":
			c.AllowCorrupt = true
		case "no_partitions":
			c.NoPartitions = true
		case "allow_backing_outside":
			if !hasVal || val == "" {
				return fmt.Errorf("option %s: want a folder", o)
			}
			c.AllowBackingOutside = append(c.AllowBackingOutside, val)
		case "foreground":
			c.Foreground = true
		case "l2_cache_size":
			if err := c.L2CacheSize.UnmarshalText([]byte(val)); err != nil || !hasVal {
				return fmt.Errorf("option %s: want a size such as 32M", o)
			}
		case "cache_size":
			if err := c.CacheSize.UnmarshalText([]byte(val)); err != nil || !hasVal {
				return fmt.Errorf("option %s: want a size such as 64M", o)
			}
		case "metadata_memory":
			if err := c.MetadataMemory.UnmarshalText([]byte(val)); err != nil || !hasVal {
				return fmt.Errorf("option %s: want a size such as 512M", o)
			}
		case "read_ahead":
			if err := c.ReadAhead.UnmarshalText([]byte(val)); err != nil || !hasVal {
				return fmt.Errorf("option %s: want a size such as 4M", o)
			}
		case "read_path":
			if val != "splice" && val != "copy" {
				return fmt.Errorf("option %s: want splice or copy", o)
			}
			c.ReadPath = val
		case "log_level":
			switch val {
			case "debug", "info", "warn", "error":
				c.LogLevel = val
			default:
				return fmt.Errorf("option %s: want debug, info, warn or error", o)
			}
		case "log_file":
			c.LogFile = val
		default:
			if strings.HasPrefix(key, "x-") {
				continue
			}
			return fmt.Errorf("unknown mount option %q", o)
		}
	}
	return nil
}

// preflight checks everything a user can get wrong before anything is
// mounted, so that each mistake is a one-line message and nothing is left
// half-mounted.
func (c *mountCmd) preflight() error {
	var err error
	if c.Source, err = filepath.Abs(c.Source); err != nil {
		return err
	}
	if c.Mountpoint, err = filepath.Abs(c.Mountpoint); err != nil {
		return err
	}
	st, err := os.Stat(c.Source)
	if err != nil {
		return fmt.Errorf("source: %w", err)
	}
	switch {
	case st.IsDir():
	case st.Mode().IsRegular():
		// A single image: refuse it now rather than mount an empty
		// folder.
		img, err := qcow2.Open(c.Source, qcow2.Options{Cache: qcow2.NewCache(1<<20, 0)})
		if err != nil {
			return fmt.Errorf("source: %w", err)
		}
		img.Close()
	default:
		return fmt.Errorf("source %s: not a folder or a regular file", c.Source)
	}
	mst, err := os.Stat(c.Mountpoint)
	if err != nil {
		return fmt.Errorf("mount point: %w", err)
	}
	if !mst.IsDir() {
		return fmt.Errorf("mount point %s: not a folder", c.Mountpoint)
	}
	realMnt, err := filepath.EvalSymlinks(c.Mountpoint)
	if err != nil {
		return fmt.Errorf("mount point: %w", err)
	}
	if m, err := mountAt(realMnt); err != nil {
		return err
	} else if m != nil {
		how := "umount"
		if m.fstype == "fuse.qcowfs" {
			how = "qcowfs unmount"
		}
		return fmt.Errorf("mount point %s: already a mount point (%s; unmount it first: %s %s)", c.Mountpoint, m.fstype, how, c.Mountpoint)
	}
	realSrc, err := filepath.EvalSymlinks(c.Source)
	if err != nil {
		return fmt.Errorf("source: %w", err)
	}
	if st.IsDir() && (realMnt == realSrc || strings.HasPrefix(realMnt, realSrc+"/")) {
		return fmt.Errorf("mount point %s: inside the source folder %s; the mount would contain itself", c.Mountpoint, c.Source)
	}
	if strings.HasPrefix(realSrc, realMnt+"/") {
		// The daemon reads the source by path: mounted over, every
		// lookup would come back to the daemon itself and hang.
		return fmt.Errorf("source %s: inside the mount point %s; the mount would hide its own source", c.Source, c.Mountpoint)
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		return fmt.Errorf("FUSE is not available: %w (load the fuse module; in a container, pass the /dev/fuse device)", err)
	}
	if os.Geteuid() == 0 {
		f, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0)
		if err != nil {
			return fmt.Errorf("FUSE is not available: %w", err)
		}
		f.Close()
	} else if _, err := exec.LookPath("fusermount3"); err != nil {
		if _, err2 := exec.LookPath("fusermount"); err2 != nil {
			return fmt.Errorf("not running as root and fusermount3 is not installed (install the fuse3 package, or run as root)")
		}
	}
	if c.AllowOther && os.Geteuid() != 0 {
		if b, err := os.ReadFile("/etc/fuse.conf"); err != nil || !hasUserAllowOther(b) {
			return fmt.Errorf("--allow-other as non-root needs user_allow_other in /etc/fuse.conf")
		}
	}
	return nil
}

func hasUserAllowOther(conf []byte) bool {
	for _, line := range strings.Split(string(conf), "\n") {
		if strings.TrimSpace(line) == "user_allow_other" {
			return true
		}
	}
	return false
}

// mountAt returns the topmost mount on path (without symlinks), from
// /proc/self/mountinfo, or nil if path is not a mount point.
func mountAt(path string) (*mountInfo, error) {
	mounts, err := readMountinfo()
	if err != nil {
		return nil, err
	}
	// Mounts stacked on path: the top one is no other's parent.
	var on []*mountInfo
	for i := range mounts {
		if mounts[i].point == path {
			on = append(on, &mounts[i])
		}
	}
	for _, m := range on {
		top := true
		for _, o := range on {
			if o.parent == m.id && o != m {
				top = false
			}
		}
		if top {
			return m, nil
		}
	}
	return nil, nil
}

type mountInfo struct {
	id, parent    string
	point, fstype string
}

func readMountinfo() ([]mountInfo, error) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	var out []mountInfo
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		// ID parent major:minor root point options [optional...] - fstype source superopts
		if len(f) < 7 {
			continue
		}
		m := mountInfo{id: f[0], parent: f[1], point: unescapeMount(f[4])}
		for i := 6; i < len(f)-1; i++ {
			if f[i] == "-" {
				m.fstype = f[i+1]
				break
			}
		}
		out = append(out, m)
	}
	return out, nil
}

// unescapeMount undoes the octal escapes (\040 for space, ...) of
// /proc/self/mountinfo.
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// daemonize re-executes this program as the daemon and waits for it to
// report that the mount is live, or why it failed.
func (c *mountCmd) daemonize() error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	r, w, err := os.Pipe()
	if err != nil {
		return err
	}
	devnull, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer devnull.Close()
	cmd := exec.Command(exe, os.Args[1:]...)
	cmd.Env = append(os.Environ(), daemonEnv+"=1")
	cmd.ExtraFiles = []*os.File{w}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = devnull, devnull, devnull
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return err
	}
	w.Close()
	defer r.Close()
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "ok":
			return cmd.Process.Release()
		case strings.HasPrefix(line, "error: "):
			cmd.Wait()
			return errors.New(strings.TrimPrefix(line, "error: "))
		default:
			fmt.Fprintln(os.Stderr, "qcowfs:", line)
		}
	}
	err = cmd.Wait()
	return fmt.Errorf("the daemon exited before the mount was live: %v", err)
}

// serve mounts and serves until unmounted. ready, if not nil, is the pipe
// to the waiting parent: it gets "ok" once the mount is live or "error:
// ..." if mounting failed.
func (c *mountCmd) serve(ready *os.File) (err error) {
	report := func(format string, args ...any) {
		if ready != nil {
			fmt.Fprintf(ready, format+"\n", args...)
		}
	}
	defer func() {
		if err != nil {
			err = reportFailure(ready, err)
		}
	}()

	logger, logOut, err := c.logger(ready != nil, report)
	if err != nil {
		return err
	}
	if ready != nil {
		// Do not keep the caller's working folder busy.
		os.Chdir("/")
	}
	cfg := fs.Config{
		Source: c.Source,
		Image:  qcow2.Options{Cache: qcow2.NewCache(int64(c.L2CacheSize), int64(c.CacheSize)), Budget: qcow2.NewBudget(int64(c.MetadataMemory))},
		Log:    logger,
	}
	if c.ReadPath == "copy" {
		cfg.ReadPath = fs.ReadCopy
	}
	cfg.ForceShare = c.ForceShare
	cfg.Image.AllowCorrupt = c.AllowCorrupt
	cfg.NoPartitions = c.NoPartitions
	for _, d := range c.AllowBackingOutside {
		abs, err := filepath.Abs(d)
		if err != nil {
			return err
		}
		cfg.Image.AllowedDirs = append(cfg.Image.AllowedDirs, abs)
	}
	root, err := fs.NewRoot(cfg)
	if err != nil {
		return err
	}
	opts := fs.Options()
	opts.AllowOther = c.AllowOther
	opts.Debug = c.Debug
	opts.Logger = log.New(logOut, "", log.LstdFlags)
	opts.MountOptions.Logger = opts.Logger
	opts.FsName = c.Source
	// Catch signals before mounting: one arriving between the mount and
	// signal.Notify would kill the process and leave a dead mount behind.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	signal.Ignore(syscall.SIGHUP, syscall.SIGPIPE)
	defer signal.Stop(sigs)
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
	server, err := gofs.Mount(c.Mountpoint, root, opts)
	if err != nil {
		return fmt.Errorf("mounting on %s: %w", c.Mountpoint, err)
	}
	if os.Geteuid() == 0 && c.ReadAhead > 0 {
		if err := fs.SetReadAhead(c.Mountpoint, int(c.ReadAhead>>10)); err != nil {
			logger.Warn("cannot raise the kernel readahead; sequential reads will be slower", "err", err)
		}
	}
	logger.Info("mounted", "source", c.Source, "mountpoint", c.Mountpoint, "pid", os.Getpid())
	if ready != nil {
		report("ok")
		ready.Close()
	}

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
	root.Close()
	logger.Info("unmounted", "mountpoint", c.Mountpoint)
	return nil
}

// logger builds the daemon's logger: to --log-file if given, else stderr
// in the foreground, else syslog. It also returns the writer for FUSE
// debug output.
func (c *mountCmd) logger(daemon bool, warn func(string, ...any)) (*slog.Logger, io.Writer, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(c.LogLevel)); err != nil {
		return nil, nil, err
	}
	var out io.Writer = os.Stderr
	switch {
	case c.LogFile != "":
		f, err := os.OpenFile(c.LogFile, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
		if err != nil {
			return nil, nil, fmt.Errorf("log file: %w", err)
		}
		out = f
	case daemon:
		w, err := syslog.New(syslog.LOG_DAEMON|syslog.LOG_INFO, "qcowfs")
		if err != nil {
			warn("no syslog (%v): the daemon's log is discarded; use --log-file", err)
			out = io.Discard
		} else {
			out = w
		}
	}
	h := slog.NewTextHandler(out, &slog.HandlerOptions{Level: level})
	return slog.New(h), out, nil
}
