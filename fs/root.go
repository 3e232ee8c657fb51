// Package fs presents a folder of qcow2 images as a FUSE file system of raw
// disk files. It knows FUSE and the naming rule; everything about the image
// format comes from package qcow2.
//
// The tree mirrors the source folder: folders are folders, qcow2 images
// (found by their magic bytes) are read-only raw files of the image's
// virtual size (see names.go for how they are named), other regular files
// appear unchanged, read-only. The source is read again on every lookup
// and listing, so files added or removed while mounted appear and
// disappear.
package fs

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"math/bits"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/qcowfs/qcowfs/qcow2"
)

// Config is what a mount needs to know.
type Config struct {
	// Source is a folder, or a single image file, to present.
	Source string
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
}

// Timeouts the kernel may cache entries and attributes for. Folders can
// change under us, so their entries are cached briefly; an image node
// stands for one version of one file (its generation number changes when
// the file does), so its attributes never change.
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
	cfg  Config
	log  *slog.Logger
	root string // the source folder, after symlinks

	mu     sync.Mutex            // guards images
	images map[diskID]*openImage // images with open handles

	usage *usageTable // st_blocks of images, see usage.go

	tablesMu sync.Mutex               // guards tables
	tables   map[diskID]*tableOrError // partition tables of disks, see parts.go
}

// NewRoot returns the root node for cfg.Source and the options the mount
// should use.
func NewRoot(cfg Config) (gofs.InodeEmbedder, error) {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Image.Cache == nil {
		cfg.Image.Cache = qcow2.NewCache(qcow2.DefaultCacheSize, qcow2.DefaultClusterCacheSize)
	}
	src, err := filepath.Abs(cfg.Source)
	if err != nil {
		return nil, err
	}
	src, err = filepath.EvalSymlinks(src)
	if err != nil {
		return nil, err
	}
	st, err := os.Stat(src)
	if err != nil {
		return nil, err
	}
	m := &mount{cfg: cfg, log: cfg.Log, images: map[diskID]*openImage{}, usage: newUsageTable(), tables: map[diskID]*tableOrError{}}
	go m.countUsage()
	if st.IsDir() {
		m.root = src
		// Backing files must stay inside what the user mounted, plus
		// whatever else the caller allows.
		m.cfg.Image.AllowedDirs = append([]string{src}, cfg.Image.AllowedDirs...)
		return &dirNode{m: m, path: src}, nil
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%s: not a folder or a regular file", cfg.Source)
	}
	// A single file: a folder holding just that file.
	m.root = filepath.Dir(src)
	m.cfg.Image.AllowedDirs = append([]string{m.root}, cfg.Image.AllowedDirs...)
	return &dirNode{m: m, path: m.root, only: filepath.Base(src)}, nil
}

// Options returns go-fuse options suited to a read-only image mount.
func Options() *gofs.Options {
	et, at := entryTimeout, dirAttrTimeout
	neg := time.Duration(0)
	return &gofs.Options{
		EntryTimeout:    &et,
		AttrTimeout:     &at,
		NegativeTimeout: &neg,
		MountOptions: fuse.MountOptions{
			FsName:      "qcowfs",
			Name:        "qcowfs",
			DirectMount: true,
			// Read-only at the mount level too, as mount(8) shows it.
			DirectMountFlags: syscall.MS_RDONLY | syscall.MS_NOSUID | syscall.MS_NODEV,
			MaxWrite:         maxRead,
			MaxReadAhead:     maxRead,
			MaxBackground:    64,
			Options:          []string{"ro", "default_permissions"},
		},
	}
}

// version identifies one version of one file: if any part changes, the
// file is treated as a different one.
type version struct {
	dev, ino     uint64
	size         int64
	mtime, ctime int64 // nanoseconds
}

func versionOf(st *syscall.Stat_t) version {
	return version{
		dev: st.Dev, ino: st.Ino, size: st.Size,
		mtime: st.Mtim.Nano(), ctime: st.Ctim.Nano(),
	}
}

// ino is the inode number shown for the file: the host inode number with
// the device mixed into the bits that host inode numbers rarely reach, so
// files of different file systems under the source rarely collide.
func (v version) inode() uint64 { return v.ino ^ bits.RotateLeft64(v.dev, 40) }

// gen is the generation number: it changes whenever the file does.
func (v version) generation() uint64 {
	h := uint64(v.size)*0x9e3779b97f4a7c15 ^ uint64(v.mtime)*0xbf58476d1ce4e5b9 ^ uint64(v.ctime)*0x94d049bb133111eb
	return h | 1
}

// diskID names a disk the mount shows: one version of an image file, or
// one internal snapshot of it.
type diskID struct {
	v    version
	snap string // snapshot ID; "" for the image's current state
	// part is a partition number of the disk (parts.go): 0 for the
	// whole disk, partsFolder for the folder of its partitions.
	part int
}

const partsFolder = -1

// base is the whole disk d is part of.
func (d diskID) base() diskID { return diskID{v: d.v, snap: d.snap} }

// inode is the disk's inode number: the image file's for the image
// itself; for a snapshot, a partition or a partitions folder, a hash of
// the file, snapshot ID and partition with the top bit set, a range host
// inode numbers do not reach.
func (d diskID) inode() uint64 {
	if d.snap == "" && d.part == 0 {
		return d.v.inode()
	}
	h := fnv.New64a()
	fmt.Fprintf(h, "%d/%d/%s/%d", d.v.dev, d.v.ino, d.snap, d.part)
	return h.Sum64() | 1<<63
}

// openImage is an open image, shared by everything that holds it: the
// listing that shows it (which keeps it open, and so locked, while it is
// shown), FUSE handles, and the usage counter.
type openImage struct {
	img    *qcow2.Image
	refs   int
	path   string
	failed bool // a read failed; logged once
	mu     sync.Mutex
}

// acquire returns the open image for disk d of the image at path,
// opening it if no handle has it open. Every acquire is paired with a
// release.
func (m *mount) acquire(path string, d diskID) (*openImage, error) {
	d = d.base() // partitions share their disk's image
	m.mu.Lock()
	defer m.mu.Unlock()
	if oi := m.images[d]; oi != nil {
		oi.refs++
		return oi, nil
	}
	opts := m.imageOptions()
	opts.Snapshot = d.snap
	img, err := qcow2.Open(path, opts)
	if err != nil {
		return nil, err
	}
	// Lock like a read-only qemu: refuse an image a qemu writes to, and
	// make a qemu that wants to write this one fail, while it is shown.
	if err := img.Lock(m.cfg.ForceShare); err != nil {
		img.Close()
		return nil, err
	}
	// The file may have changed since it was looked up.
	var st syscall.Stat_t
	fd, ok := img.File().(interface{ Fd() uintptr })
	if !ok || syscall.Fstat(int(fd.Fd()), &st) != nil || versionOf(&st) != d.v {
		img.Close()
		return nil, syscall.ESTALE
	}
	oi := &openImage{img: img, refs: 1, path: path}
	m.images[d] = oi
	return oi, nil
}

func (m *mount) release(d diskID, oi *openImage) {
	d = d.base()
	m.mu.Lock()
	defer m.mu.Unlock()
	oi.refs--
	if oi.refs == 0 {
		delete(m.images, d)
		oi.img.Close()
	}
}

func (m *mount) imageOptions() qcow2.Options {
	o := m.cfg.Image
	o.Warnf = func(format string, args ...any) { m.log.Warn(fmt.Sprintf(format, args...)) }
	return o
}

// readFailed logs a failed read once per open image, and maps the error.
func (m *mount) readFailed(oi *openImage, off int64, err error) syscall.Errno {
	oi.mu.Lock()
	first := !oi.failed
	oi.failed = true
	oi.mu.Unlock()
	if first {
		m.log.Error("read failed; further read errors of this image are not logged",
			"image", oi.path, "offset", off, "err", err)
	}
	return errnoOf(err)
}

// errnoOf maps a library error to the errno a reader sees: corrupt or
// unreadable metadata is EIO.
func errnoOf(err error) syscall.Errno {
	var errno syscall.Errno
	switch {
	case err == nil:
		return 0
	case errors.As(err, &errno):
		return errno
	default:
		return syscall.EIO
	}
}

var _ = (gofs.NodeStatfser)((*dirNode)(nil))

// Statfs reports the source file system's numbers.
func (d *dirNode) Statfs(ctx context.Context, out *fuse.StatfsOut) syscall.Errno {
	var st syscall.Statfs_t
	if err := syscall.Statfs(d.path, &st); err != nil {
		return gofs.ToErrno(err)
	}
	out.FromStatfsT(&st)
	return 0
}
