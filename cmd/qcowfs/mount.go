package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/qcowfs/qcowfs/internal/keys"
	"github.com/qcowfs/qcowfs/internal/mountinfo"
	"github.com/qcowfs/qcowfs/internal/remotefile"
	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/remote"
)

type mountCmd struct {
	Source              string   `arg:"" help:"Folder of qcow2 images (searched recursively), or one image file; or a remote source: the http://, https:// or s3:// URL of one image, or an s3://BUCKET/PREFIX/ (ending with a slash) whose qcow2 objects are shown in folders mirroring their keys."`
	Mountpoint          string   `arg:"" help:"Folder to mount on."`
	Foreground          bool     `short:"f" help:"Stay in the foreground and log to stderr; unmount on SIGINT or SIGTERM."`
	AllowOther          bool     `help:"Let other users read the mount (as non-root this needs user_allow_other in /etc/fuse.conf). File permissions still apply."`
	L2CacheSize         byteSize `name:"l2-cache-size" default:"32M" placeholder:"SIZE" help:"Memory for L2 tables, shared by all images: 32M maps 256 GiB of disk at 64 KiB clusters (default: ${default})."`
	CacheSize           byteSize `default:"64M" placeholder:"SIZE" help:"Memory for decompressed clusters of compressed images, shared by all images (default: ${default})."`
	MetadataMemory      byteSize `default:"512M" placeholder:"SIZE" help:"Memory for the metadata images keep while open (L1, snapshot and refcount tables, metadata maps), shared by all images; an image that does not fit is not served (default: ${default})."`
	ReadAhead           byteSize `default:"4M" placeholder:"SIZE" help:"Kernel readahead for the mount (root only; the kernel's FUSE default is 128K) (default: ${default})."`
	ReadPath            string   `enum:"splice,copy" default:"splice" help:"How reads of uncompressed data are answered: splice (zero-copy from the image file) or copy (through a buffer)."`
	IOUring             string   `name:"io-uring" enum:"auto,on,off" default:"auto" help:"Serve requests over FUSE over io_uring (Linux 6.14 or later, with /sys/module/fuse/parameters/enable_uring set to Y by root): auto uses it when the kernel offers it, on fails the mount when it does not, off reads /dev/fuse (default: ${default}). See FUSE over io_uring in the README."`
	LogLevel            string   `enum:"debug,info,warn,error" default:"info" help:"Least severe log messages to keep: debug, info, warn or error."`
	LogFile             string   `placeholder:"PATH" help:"Append the daemon's log here. Default: syslog; without syslog (no /dev/log) /run/qcowfs/MNT.log as root, $$XDG_RUNTIME_DIR/qcowfs/MNT.log otherwise; stderr with --foreground. SIGHUP reopens it."`
	Debug               bool     `help:"Log every FUSE request and reply (very verbose)."`
	CPUProfile          string   `placeholder:"PATH" help:"Write a Go CPU profile of the daemon here, from mount to unmount."`
	AllowBackingOutside []string `placeholder:"DIR" sep:"none" help:"Also follow backing and data files that resolve inside DIR, or for remote images under DIR given as a URL prefix (repeat the flag for more). By default they must lie inside the source folder (or under the source's URL prefix)."`
	AllowCorrupt        bool     `help:"Serve images qemu marked corrupt (read-only, with a warning in the log)."`
	NoPartitions        bool     `help:"Do not show the folders of guest partitions (STEM.raw.parts/p1, ...)."`
	NoBitmapViews       bool     `help:"Do not show the folders of changed-blocks views of persistent dirty bitmaps (STEM.raw.bitmaps/NAME.raw)."`
	ForceShare          bool     `short:"U" help:"Serve images that another process (a running qemu) has open for writing, like qemu-img -U; their content may change under the reader. Not with --writable."`
	Writable            bool     `help:"Make the raw files of qcow2 images writable: writes, discards (fstrim), zeroing and growing go into the images, crash-safe (see Writing in the README). Snapshots, partitions of snapshots and plain files stay read-only."`
	NoWritebackCache    bool     `help:"With --writable: send each buffered write to qcowfs as it is made (write-through) instead of through the kernel's writeback cache. A write across the end of the disk then returns the bytes that fit, and the next one fails with ENOSPC, instead of fsync or close failing; loop-mounted guests and small buffered writes are slower. See Writing in the README."`
	// WritebackCache is the default with --writable; the flag stays for
	// command lines written when it was not.
	WritebackCache    bool          `hidden:"" help:"The default with --writable."`
	Overlay           string        `placeholder:"DIR" help:"With --writable: never change the images; the first write to an image makes its overlay DIR/REL (a qcow2 whose backing file is the original, by path or URL; REL is the image's path below the source), and writes go there; a later mount with the same DIR picks them up. DIR must lie outside the source and the mount point. --overlay=temp: throwaway overlays in a folder of the daemon's own, removed at unmount (a folder named temp: ./temp). Required for --writable with a URL. See Overlays in the README."`
	Hydrate           hydrateFlag   `placeholder:"RATE" help:"Remote images, with --cache-dir: once a reader opens an image, fetch everything a read of the whole disk needs (its tables and data clusters, never holes) into the disk cache in the background, readers first; --hydrate=RATE caps it at RATE bytes a second (50M). See Hydration in the README."`
	AcceptChangedBase bool          `help:"Serve an overlay of a remote image even if its base is no longer the version the overlay was made on (the mount refuses such overlays, naming both versions): its writes then land on another base."`
	Offline           bool          `help:"The URL of one image, with --cache-dir: send no request; serve the version of the image (and of its remote backing files) that the last mount with the server up opened, from the disk cache alone, as while the server is down. A read of what the cache does not hold fails with EIO, logged once per file; hydrate the image first (--hydrate) to have all of it. See Offline in the README."`
	FSName            string        `name:"fsname" placeholder:"NAME" help:"What mount, df and findmnt show as the source (default: the source path)."`
	RemoteRefresh     time.Duration `default:"30s" placeholder:"DURATION" help:"Remote sources: list again when the listing is this old, at the next lookup or listing; objects added or replaced show up then (default: ${default})."`
	remoteFlags       `embed:""`
	keyFlags          `embed:""`
	Options           []string `short:"o" sep:"none" placeholder:"OPT,..." help:"${options_help}"`
	// Fake is mount(8)'s -f: mount nothing.
	Fake bool `hidden:"" help:"Mount nothing (mount -f)."`
	// RO is the ro option: read-only, whatever else is given.
	RO bool `name:"ro" hidden:"" help:"Read-only, even with --writable (-o ro)."`
	// NoFail is the nofail option: a missing source is no error.
	NoFail bool `name:"nofail" hidden:"" help:"A missing source is not an error (fstab nofail)."`

	// keys are the passphrases of --key-file and --key-dir (nil
	// without either), loaded by Run; daemonizing is set in the
	// process that starts the daemon, which leaves unlocking to it.
	keys        *keys.Ring
	daemonizing bool
	// keyCache keeps the master keys the mount unlocked (nil without
	// keys), until the mount ends.
	keyCache *qcow2.KeyCache
}

func (c *mountCmd) Help() string {
	return `Examples:

  qcowfs mount ~/vms /mnt/vms                 every image under ~/vms, as raw files
  qcowfs mount vm.qcow2 /mnt/vm               one image
  qcowfs mount -U --allow-other /srv/vms /mnt/vms
  mount -t fuse.qcowfs /srv/vms /mnt/vms -o allow_other,cache_size=256M

qcowfs mount returns once the mount is live and prints one line for each
image it does not show (and why). The daemon serves until the mount is
unmounted: qcowfs unmount MNT, umount MNT or fusermount3 -u MNT. As a
mount helper (mount -t fuse.qcowfs, /etc/fstab), every flag is an -o
option with underscores. The files and folders the mount reads or writes
for itself (--log-file, --cache-dir, the keys, the overlays, $TMPDIR with
--overlay=temp) must lie outside the mount point and the source folder.`
}

// daemonEnv marks the re-executed daemon; fd 3 is then the pipe on which it
// reports to the waiting parent.
const daemonEnv = "QCOWFS_DAEMON"

// Run mounts. Without --foreground the mount is served by a re-executed
// copy of this program in its own session; this process waits until the
// mount is live (or failed) and exits with that result.
func (c *mountCmd) Run(inv *invocation) error {
	var ready *os.File
	if os.Getenv(daemonEnv) != "" {
		os.Unsetenv(daemonEnv)
		ready = os.NewFile(3, "ready")
	}
	if len(c.Options) > 0 {
		// rewriteOptions takes every -o it can see; this one was
		// hidden in a cluster of short flags.
		return reportFailure(ready, usageErrorf("-o %s: give -o as an argument of its own", strings.Join(c.Options, ",")))
	}
	if c.Fake {
		// mount -f records a mount without making it, often for a
		// mount that exists already: check nothing more.
		return nil
	}
	if err := c.resolvePaths(); err != nil {
		return reportFailure(ready, err)
	}
	ring, warnings, err := c.loadKeys(ready != nil)
	if err != nil {
		return reportFailure(ready, err)
	}
	c.keys = ring
	defer ring.Close()
	if !ring.Empty() {
		c.keyCache = qcow2.NewKeyCache()
		defer c.keyCache.Close()
	}
	if ready == nil {
		warnings = append(warnings, c.modeWarnings(inv)...)
	}
	for _, w := range warnings {
		fmt.Fprintf(os.Stderr, "qcowfs: warning: %s\n", w)
	}
	c.daemonizing = ready == nil && !c.Foreground
	// Throwaway overlays of daemons killed before they removed them.
	removeStaleTempOverlays()
	// The daemon checks again: things may have changed since the parent
	// did, and its reason must reach the parent, not /dev/null.
	if err := c.preflight(); err != nil {
		if c.NoFail && sourceMissing(err) {
			// What mount(8) does for nofail and a missing
			// device: exit 0, silently (libmount,
			// mnt_context_get_mount_excode).
			return reportFailure(ready, nil)
		}
		return reportFailure(ready, err)
	}
	if c.Foreground {
		return c.serve(nil)
	}
	if ready != nil {
		return c.serve(ready)
	}
	return c.daemonize(inv)
}

// modeWarnings says when the mount will be read-only although the
// command line asked for writes: rw alone (qcowfs writes only with
// writable), or ro beside writable (ro wins).
func (c *mountCmd) modeWarnings(inv *invocation) []string {
	switch {
	case c.RO && c.Writable:
		return []string{"ro and writable both given: ro wins, the mount is read-only"}
	case inv.rwOption && !c.Writable:
		return []string{"option rw: the mount is read-only; qcowfs writes only with -o writable (--writable)"}
	}
	return nil
}

// resolvePaths makes every path flag absolute against the caller's
// working folder, before anything (the daemon) changes folder.
func (c *mountCmd) resolvePaths() error {
	if err := c.absPaths(); err != nil {
		return err
	}
	if err := c.absKeyPaths(); err != nil {
		return err
	}
	paths := []*string{&c.Mountpoint, &c.LogFile, &c.CPUProfile}
	if !remote.IsURL(c.Source) {
		paths = append(paths, &c.Source)
	}
	if c.Overlay != tempOverlay && !remote.IsURL(c.Overlay) {
		paths = append(paths, &c.Overlay)
	}
	if err := makeAbs(paths...); err != nil {
		return err
	}
	// The daemon leaves the caller's working folder: a relative TMPDIR
	// (throwaway overlays) or XDG_RUNTIME_DIR (the control socket) it
	// inherits must be the caller's too.
	for _, env := range []string{"TMPDIR", "XDG_RUNTIME_DIR"} {
		if d := os.Getenv(env); d != "" && !filepath.IsAbs(d) {
			abs, err := filepath.Abs(d)
			if err != nil {
				return err
			}
			os.Setenv(env, abs)
		}
	}
	for i, d := range c.AllowBackingOutside {
		if remote.IsURL(d) {
			continue
		}
		abs, err := filepath.Abs(d)
		if err != nil {
			return err
		}
		c.AllowBackingOutside[i] = abs
	}
	return nil
}

// errSourceMissing marks a preflight failure because the source does not
// exist, which nofail forgives.
type errSourceMissing struct{ err error }

func (e *errSourceMissing) Error() string { return "source: " + e.err.Error() }
func (e *errSourceMissing) Unwrap() error { return e.err }

func sourceMissing(err error) bool {
	_, ok := err.(*errSourceMissing)
	return ok
}

// preflight checks everything a user can get wrong before anything is
// mounted, so that each mistake is a one-line message and nothing is left
// half-mounted.
func (c *mountCmd) preflight() error {
	if c.RO {
		c.Writable = false
	}
	if (c.WritebackCache || c.NoWritebackCache) && !c.Writable {
		return usageErrorf("--writeback-cache and --no-writeback-cache need --writable")
	}
	if c.WritebackCache && c.NoWritebackCache {
		return usageErrorf("--writeback-cache and --no-writeback-cache cannot both be given")
	}
	if c.Overlay != "" && !c.Writable {
		return usageErrorf("--overlay needs --writable: an overlay holds what is written")
	}
	if c.AcceptChangedBase && c.Overlay == "" {
		return usageErrorf("--accept-changed-base needs --overlay: it is about overlays of remote images")
	}
	if c.Writable && c.ForceShare {
		return fmt.Errorf("--force-share cannot be used with --writable: writing an image that another process writes would corrupt it")
	}
	isURL := remote.IsURL(c.Source)
	var st os.FileInfo
	if isURL {
		if c.Writable && c.Overlay == "" {
			return usageErrorf("--writable with a URL needs --overlay DIR (or --overlay=temp): remote images are only read, their writes go to overlays")
		}
		if err := c.keyRoots(); err != nil {
			return err
		}
		// (checkRemote comes after the checks of the mount point and
		// the mount's own folders: it makes the disk cache's.)
	} else {
		var err error
		if st, err = os.Stat(c.Source); err != nil {
			return &errSourceMissing{err}
		}
		if err := c.keyRoots(); err != nil {
			return err
		}
		switch {
		case st.IsDir():
		case st.Mode().IsRegular():
			// A single image: refuse it now, for whatever reason
			// the mount would not show it, rather than mount an
			// empty folder.
			if err := c.checkSingleImage(); err != nil {
				return fmt.Errorf("source: %w", err)
			}
		default:
			return fmt.Errorf("source %s: not a folder or a regular file", c.Source)
		}
	}
	// (After the source's checks: a missing source says so first.)
	if c.Offline {
		switch {
		case !remote.IsURL(c.Source) || c.CacheDir == "":
			return usageErrorf("--offline needs a remote source and --cache-dir: it serves a remote image from the disk cache")
		case remotefile.IsPrefix(c.Source):
			return usageErrorf("--offline serves the URL of one image, not a prefix: the disk cache keeps no listing")
		case c.Hydrate.On:
			return usageErrorf("--offline and --hydrate cannot both be given: hydration fetches, offline nothing is fetched")
		}
		c.offline = true
	}
	mst, err := os.Stat(c.Mountpoint)
	if errors.Is(err, syscall.ENOTCONN) {
		// A FUSE mount whose daemon died is still mounted there.
		if m, _ := mountinfo.At(c.Mountpoint); m != nil {
			return fmt.Errorf("mount point %s: already a mount point, whose daemon is gone (%s; detach it first: qcowfs unmount -z %s)", c.Mountpoint, m.FSType, c.Mountpoint)
		}
	}
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
	if m, err := mountinfo.At(realMnt); err != nil {
		return err
	} else if m != nil {
		how := "umount"
		if m.FSType == "fuse.qcowfs" {
			how = "qcowfs unmount"
		}
		return fmt.Errorf("mount point %s: already a mount point (%s; unmount it first: %s %s)", c.Mountpoint, m.FSType, how, c.Mountpoint)
	}
	if !isURL {
		realSrc, err := filepath.EvalSymlinks(c.Source)
		if err != nil {
			return fmt.Errorf("source: %w", err)
		}
		if st.IsDir() && within(realMnt, realSrc) {
			return fmt.Errorf("mount point %s: inside the source folder %s; the mount would contain itself (mount a folder that does not hold the mount point)", c.Mountpoint, c.Source)
		}
		if within(realSrc, realMnt) {
			// The daemon reads the source by path: mounted over,
			// every lookup would come back to the daemon itself
			// and hang.
			return fmt.Errorf("source %s: inside the mount point %s; the mount would hide its own source", c.Source, c.Mountpoint)
		}
		srcDir, img := realSrc, ""
		if !st.IsDir() {
			srcDir, img = "", realSrc
		}
		if err := c.checkOwnPaths(realMnt, srcDir, img); err != nil {
			return err
		}
		if c.Overlay != "" && c.Overlay != tempOverlay {
			srcDir := realSrc
			if !st.IsDir() {
				srcDir = filepath.Dir(realSrc)
			}
			if err := checkOverlayDir(c.Overlay, srcDir, realMnt); err != nil {
				return err
			}
		}
	} else {
		if err := c.checkOwnPaths(realMnt, "", ""); err != nil {
			return err
		}
		if c.Overlay != "" && c.Overlay != tempOverlay {
			if err := checkOverlayDir(c.Overlay, "", realMnt); err != nil {
				return err
			}
		}
		if err := c.checkRemote(); err != nil {
			return fmt.Errorf("source: %w", err)
		}
	}
	// (After the source's checks: a missing source says so first.)
	if c.Hydrate.On && (!remote.IsURL(c.Source) || c.CacheDir == "") {
		return usageErrorf("--hydrate needs a remote source and --cache-dir: it fetches remote images into the disk cache")
	}
	if c.Overlay == tempOverlay {
		if _, err := makeTempOverlayRoot(); err != nil {
			return err
		}
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

// checkOverlayDir checks an overlay folder (absolute) against the source
// folder ("" for a remote source) and the mount point (both real paths),
// creating it if missing.
// It must not overlap either: inside the source its overlays would be
// shown as images (and could be taken for the originals they hide),
// inside the mount the daemon would write to itself, and a folder holding
// the source would put overlays where its images are.
func checkOverlayDir(dir, src, mnt string) error {
	// Where the folder will be, after symlinks, before anything is made.
	real := realPath(dir)
	switch {
	case src != "" && within(real, src):
		return fmt.Errorf("overlay folder %s: inside the source folder %s; put it outside the source", dir, src)
	case src != "" && within(src, real):
		return fmt.Errorf("overlay folder %s: holds the source folder %s; put it outside the source", dir, src)
	case within(real, mnt) || within(mnt, real):
		return fmt.Errorf("overlay folder %s: inside the mount point %s (or holding it); put it elsewhere", dir, mnt)
	}
	if err := os.MkdirAll(real, 0o755); err != nil {
		return fmt.Errorf("overlay folder: %w", err)
	}
	return nil
}

// within reports whether path is dir or lies below it (both clean and
// absolute, without symlinks).
func within(path, dir string) bool {
	return path == dir || dir == "/" || strings.HasPrefix(path, dir+"/")
}

// checkSingleImage opens the single image to be mounted the way the mount
// will, and checks its locks without taking them.
func (c *mountCmd) checkSingleImage() error {
	opts := c.imageOptions()
	opts.Cache = qcow2.NewCache(1<<20, 0)
	opts.AllowedDirs = append([]string{filepath.Dir(c.Source)}, opts.AllowedDirs...)
	img, err := qcow2.Open(c.Source, c.parentOptions(opts))
	if c.keyLeftToDaemon(err) {
		return nil
	}
	if err != nil {
		return hintWith(err, c.refusalHint(err))
	}
	defer img.Close()
	if !c.ForceShare {
		if err := img.LockConflict(); err != nil {
			return hintWith(err, c.refusalHint(err))
		}
	}
	return nil
}

// checkRemote checks a remote source before anything is mounted: a
// prefix is listed (a wrong key fails here), one image is opened the way
// the mount will open it.
func (c *mountCmd) checkRemote() error {
	client, err := c.client(nil)
	if err != nil {
		return err
	}
	defer client.Close()
	if remotefile.IsPrefix(c.Source) {
		_, err := client.List(context.Background(), c.Source)
		return err
	}
	opts := c.imageOptions()
	opts.Cache = qcow2.NewCache(1<<20, 0)
	_, urls := splitAllowed(c.AllowBackingOutside)
	img, err := openRemoteImage(client, c.Source, c.parentOptions(opts), urls)
	if c.keyLeftToDaemon(err) {
		return nil
	}
	if err != nil {
		return hintWith(err, c.refusalHint(err))
	}
	return img.Close()
}

// keyRoots gives the key ring the folders whose files --key-dir names:
// the source's, and the overlay folder, whose overlays have the
// passphrases of their originals.
func (c *mountCmd) keyRoots() error {
	if c.keys.Empty() {
		return nil
	}
	root, err := keyRoot(c.Source, true)
	if err != nil {
		return fmt.Errorf("source: %w", err)
	}
	c.keys.AddRoot(root)
	if c.Overlay != "" && c.Overlay != tempOverlay { // (serve adds a throwaway folder)
		c.keys.AddRoot(c.Overlay)
	}
	return nil
}

// parentOptions are opts for the checks of the process that starts the
// daemon: without keys, since the daemon unlocks the image anyway (and
// PBKDF2 as qemu calibrates it takes seconds).
func (c *mountCmd) parentOptions(opts qcow2.Options) qcow2.Options {
	if c.daemonizing {
		opts.Passphrase = nil
	}
	return opts
}

// keyLeftToDaemon reports whether the parent's check of a single image
// stopped only for want of the key it did not give (parentOptions).
func (c *mountCmd) keyLeftToDaemon(err error) bool {
	var ke *qcow2.KeyError
	return c.daemonizing && !c.keys.Empty() && errors.As(err, &ke) && ke.Missing
}

// imageOptions are the qcow2 options every image of the mount is opened
// with (the cache aside).
func (c *mountCmd) imageOptions() qcow2.Options {
	dirs, _ := splitAllowed(c.AllowBackingOutside)
	return qcow2.Options{AllowCorrupt: c.AllowCorrupt, AllowedDirs: dirs, Passphrase: passphrases(c.keys), KeyCache: c.keyCache}
}

func hasUserAllowOther(conf []byte) bool {
	for _, line := range strings.Split(string(conf), "\n") {
		if strings.TrimSpace(line) == "user_allow_other" {
			return true
		}
	}
	return false
}
