package fs

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/remote"
)

// Config is what a mount needs to know.
type Config struct {
	// Source is a folder, or a single image file, to present; or a URL
	// (remote.IsURL): an s3://BUCKET/PREFIX/ whose objects are shown, or
	// the http(s):// or s3:// URL of one image (remotetree.go).
	Source string
	// Remote opens remote sources; required for a URL Source.
	Remote *remote.Client
	// RemoteRefresh is how old a listing of a remote source may get
	// before the next lookup or listing lists again (default 30 s).
	RemoteRefresh time.Duration
	// AllowBackingURLs are URL prefixes, besides the mounted one, under
	// which the backing and data files of remote images may lie.
	AllowBackingURLs []string
	// Image options for every image; Cache should be set so that all
	// images share one table cache.
	Image qcow2.Options
	// Log receives one line per refused image and per image whose reads
	// fail. Nil means slog.Default().
	Log *slog.Logger
	// ReadPath selects zero-copy (the default) or copying reads.
	ReadPath ReadPath
	// ForceShare serves images other processes have open for writing,
	// like qemu-img -U, and takes no lock that would stop them.
	ForceShare bool
	// NoPartitions hides the STEM.raw.parts folders of partitions.
	NoPartitions bool
	// NoBitmapViews hides the STEM.raw.bitmaps folders of changed-blocks
	// views (bitmaps.go).
	NoBitmapViews bool
	// Hint, if set, names what would lift a refusal (a flag of the
	// command line), for log lines; "" if nothing would.
	Hint func(err error) string
	// Writable makes the raw files of qcow2 images writable (their
	// snapshots and plain files stay read-only).
	Writable bool
	// WritebackCache, with Writable, asks for the kernel's FUSE writeback
	// cache (Options sets the capability): buffered writes land in the
	// kernel's page cache and reach qcowfs in large pieces, several in
	// flight, as the kernel writes them back.
	WritebackCache bool
	// Overlay, with Writable, is a folder outside the source where the
	// writes go: the images of the source are only read, and the first
	// write to one makes its overlay there (overlay.go). Required for a
	// writable remote source.
	Overlay string
	// Hydrate: fetch each remote image a reader opens into the remote
	// client's disk cache in the background (hydrate.go).
	Hydrate bool
	// AcceptChangedBase serves overlays of remote images whose base is
	// not the version they were made on (overlaybase.go), with a log
	// line, instead of refusing them.
	AcceptChangedBase bool
	// TestHook, if set, is called at named points of the work (tests
	// use it to crash the daemon there): "overlay-prepared", when an
	// overlay is written under its temporary name.
	TestHook func(point string)
}

// Timeouts the kernel may cache entries and attributes for. Folders can
// change under us, so their entries are cached briefly; an image node
// stands for one generation of one file (identity.go), so its attributes
// only change when the data count arrives (usage.go), which tells the
// kernel.
const (
	entryTimeout     = time.Second
	dirAttrTimeout   = time.Second
	imageAttrTimeout = time.Hour
)

// maxRead is the largest read request the kernel sends us: just under
// 1 MiB, so that a spliced reply (header, payload, and the page go-fuse
// keeps spare) fits in a pipe of /proc/sys/fs/pipe-max-size, 1 MiB by
// default; at a full 1 MiB every reply would fall back to copying.
const maxRead = 1<<20 - 8<<10

// mount is the state shared by every node of one mount.
type mount struct {
	// inProcess: a test mounts the tree in its own process and reads it
	// from its own threads, which the self guard (selfguard.go) would
	// refuse.
	inProcess bool
	cfg       Config
	log       *slog.Logger
	src       tree // the local folder or the remote objects (tree.go)

	ids *identities // generations of source files, identity.go
	reg registry    // open images, registry.go
	fds *fdBudget   // descriptors for open images, fdbudget.go

	fdWarned atomic.Int64 // when the fd budget was last logged as spent

	usage *usageTable // st_blocks of images, usage.go
	errs  errorLog    // failed reads and writes, errlog.go

	views *views       // the views of each writable disk, kept coherent: views.go
	kinds requestKinds // how each READ and WRITE in flight was sent: requests.go

	refMu    sync.Mutex
	refused  map[string]error   // images not shown, by path (status.go)
	readOnly map[string]string  // images of a writable mount shown read-only, and why
	backing  map[fileKey]string // backing files of shown images, and which image reads them
	images   map[fileKey]string // the images validated, by file, and their paths

	// resized holds the virtual size of disks this mount grew, by disk
	// (diskID, whole disk): what the listing (made before) and the
	// nodes (made at lookup) say until the image is validated again.
	resized sync.Map

	// directFlushes says the kernel writes dirty pages back before a
	// direct write of their range (KernelFlags): with the writeback
	// cache, O_DIRECT writers may then write in parallel.
	directFlushes atomic.Bool

	// ctx ends the mount's background work (Root.Close).
	ctx    context.Context
	cancel context.CancelFunc

	// hydrated: the images (rel and generation) and remote files (URL
	// and version) whose hydration started (hydrate.go).
	hydMu    sync.Mutex
	hydrated map[string]bool
}

// Root is the root folder of a mount: the source folder, or for a single
// image file the folder that shows only that file.
type Root struct {
	dirNode
	firstScan sync.Once
}

// NewRoot returns the root node for cfg.Source.
func NewRoot(cfg Config) (*Root, error) {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Image.Cache == nil {
		cfg.Image.Cache = qcow2.NewCache(qcow2.DefaultCacheSize, qcow2.DefaultClusterCacheSize)
	}
	if cfg.Image.Budget == nil {
		// One memory budget for the metadata of every image.
		cfg.Image.Budget = qcow2.NewBudget(qcow2.DefaultBudget)
	}
	var src tree
	only := ""
	if remote.IsURL(cfg.Source) {
		if cfg.Writable && cfg.Overlay == "" {
			return nil, fmt.Errorf("%s: remote images are written through overlays only; --writable needs --overlay with a URL", remote.Redact(cfg.Source))
		}
		rt, name, err := openRemoteTree(cfg)
		if err != nil {
			return nil, err
		}
		src, only = rt, name
	} else {
		s, name, err := openLocal(cfg.Source)
		if err != nil {
			return nil, err
		}
		src, only = s, name
	}
	if cfg.Overlay != "" {
		if !cfg.Writable {
			return nil, errors.New("an overlay folder needs a writable mount")
		}
		var err error
		if cfg.Overlay, err = filepath.Abs(cfg.Overlay); err != nil {
			return nil, err
		}
	}
	m := &mount{cfg: cfg, log: cfg.Log, src: src, ids: newIdentities(), usage: newUsageTable(), refused: map[string]error{}, readOnly: map[string]string{}, backing: map[fileKey]string{}, images: map[fileKey]string{}, fds: newFDBudget()}
	m.views = newViews(cfg.Writable && cfg.WritebackCache)
	m.log.Debug("file descriptors", "limit", m.fds.nofile, "for open images", m.fds.limit, "per folder", m.fds.perFolder)
	m.reg.images = map[diskID]*openImage{}
	m.reg.closing = map[fileKey]int{}
	m.reg.closed = sync.NewCond(&m.reg.mu)
	m.ctx, m.cancel = context.WithCancel(context.Background())
	// Backing files must stay inside what the user mounted, plus
	// whatever else the caller allows.
	src.configure(&m.cfg.Image)
	go m.countUsage(m.ctx)
	return &Root{dirNode: dirNode{m: m, only: only}}, nil
}

// openLocal opens a local source: a folder, or a single image file (then
// the folder holding it, showing only that file, whose name is returned).
func openLocal(source string) (*source, string, error) {
	src, err := filepath.Abs(source)
	if err != nil {
		return nil, "", err
	}
	src, err = filepath.EvalSymlinks(src)
	if err != nil {
		return nil, "", err
	}
	st, err := os.Stat(src)
	if err != nil {
		return nil, "", err
	}
	root, only := src, ""
	switch {
	case st.IsDir():
	case st.Mode().IsRegular():
		// A single file: a folder holding just that file.
		root, only = filepath.Dir(src), filepath.Base(src)
	default:
		return nil, "", fmt.Errorf("%s: not a folder or a regular file", source)
	}
	s, err := openSource(root)
	if err != nil {
		return nil, "", err
	}
	return s, only, nil
}

// KernelFlags tells the mount what the kernel offered at FUSE INIT
// (fuse.Server.KernelSettings), once mounted. Until then O_DIRECT writers
// of a writeback-cached mount take the kernel's serial path.
func (r *Root) KernelFlags(flags uint64) {
	r.m.directFlushes.Store(r.m.cfg.WritebackCache && flags&fuse.CAP_DIRECT_IO_ALLOW_MMAP != 0)
}

// Close stops the mount's background work and writes back and closes
// the images still open; call it once the mount is gone.
func (r *Root) Close() {
	r.m.cancel()
	r.m.closeAll()
	r.m.src.close()
}

// Options returns go-fuse options suited to a mount of cfg: read-only
// unless writable, with the kernel's writeback cache if asked.
//
// A writable mount also asks for FUSE_DIRECT_IO_ALLOW_MMAP: a kernel that
// knows it (6.6 and later) lets FOPEN_DIRECT_IO files be mapped shared
// (the handles of a disk's views that do without the page cache:
// views.go), and writes back the dirty pages of a range before an
// FOPEN_DIRECT_IO write of it, and invalidates them after, so that with
// the writeback cache O_DIRECT writers may keep their parallel path
// (openFlags, KernelFlags) without a dirty page written back later
// overwriting what they wrote.
func Options(cfg Config) *gofs.Options {
	writable := cfg.Writable
	et, at := entryTimeout, dirAttrTimeout
	neg := time.Duration(0)
	flags := uintptr(syscall.MS_NOSUID | syscall.MS_NODEV)
	opts := []string{"default_permissions"}
	if !writable {
		flags |= syscall.MS_RDONLY
		opts = append(opts, "ro")
	}
	var caps uint64
	if writable {
		caps = fuse.CAP_DIRECT_IO_ALLOW_MMAP
		if cfg.WritebackCache {
			caps |= fuse.CAP_WRITEBACK_CACHE
		}
	}
	return &gofs.Options{
		EntryTimeout:    &et,
		AttrTimeout:     &at,
		NegativeTimeout: &neg,
		// The root has FUSE's root ID as its inode number (stat and
		// "." and ".." in listings agree on it).
		RootStableAttr: &gofs.StableAttr{Ino: fuse.FUSE_ROOT_ID},
		MountOptions: fuse.MountOptions{
			FsName:      "qcowfs",
			Name:        "qcowfs",
			DirectMount: true,
			// Read-only at the mount level too, as mount(8) shows it,
			// unless writable.
			DirectMountFlags:  flags,
			MaxWrite:          maxRead,
			MaxReadAhead:      maxRead,
			MaxBackground:     64,
			Options:           opts,
			ExtraCapabilities: caps,
		},
	}
}

var _ = (gofs.NodeStatfser)((*dirNode)(nil))

// Statfs reports the source file system's numbers.
func (d *dirNode) Statfs(ctx context.Context, out *fuse.StatfsOut) syscall.Errno {
	var st syscall.Statfs_t
	if err := d.m.src.statfs(&st); err != nil {
		return gofs.ToErrno(err)
	}
	out.FromStatfsT(&st)
	return 0
}
