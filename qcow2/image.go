package qcow2

import (
	"fmt"
	"io"
	"sync"
	"sync/atomic"
)

// Options configure Open and NewImage. The zero value is usable.
type Options struct {
	// Cache holds L2 tables. Share one Cache between all images of a
	// mount to bound the memory of all of them together. Nil means a
	// private cache of DefaultCacheSize bytes.
	Cache *Cache

	// Opener opens the backing and data files an image names. Nil means
	// the local file system, confined to AllowedDirs (LocalOpener).
	Opener Opener

	// AllowedDirs confines the default opener: when non-empty, a
	// referenced file must resolve (after symlinks) to a path inside one
	// of these folders, or the open fails with ErrRefused.
	AllowedDirs []string

	// MaxChainDepth limits the number of backing files below the image.
	// Zero means DefaultMaxChainDepth.
	MaxChainDepth int

	// NoBacking opens the image without its backing chain, like qemu's
	// BDRV_O_NO_BACKING: enough to describe it (Info), not to read it:
	// unallocated ranges then read as zeros.
	NoBacking bool

	// Snapshot, when set, opens the internal snapshot with this ID (or
	// else name) instead of the image's current state: its own L1 table
	// and virtual size, over the same backing chain.
	Snapshot string

	// SnapshotIndex, when not 0, opens the snapshot at index
	// SnapshotIndex-1 of the snapshot table instead, whatever its ID:
	// in a hostile table IDs can repeat, entries cannot.
	SnapshotIndex int

	// LenientTables skips checking every L1 entry at open, for image
	// checkers that report bad entries rather than refuse the image.
	// Reads through a bad entry still fail.
	LenientTables bool

	// AllowCorrupt opens images whose corrupt bit is set. They are only
	// ever read, so this cannot make them worse.
	AllowCorrupt bool

	// Writable opens the image for writing: its file must be a
	// WritableFile (as is an *os.File opened read-write), its data file is
	// opened for writing through the Opener (a WritableOpener). An image
	// that cannot be written safely opens read-only all the same, and
	// ReadOnlyReason says why. Backing files are never written.
	Writable bool

	// Budget bounds the memory of the structures read from image files
	// (budget.go). Share one between all images of a mount. Nil means a
	// private budget of DefaultBudget bytes.
	Budget *Budget

	// Passphrase returns the passphrase of an encrypted image file (as
	// its HostFile names it), nil if none is known: then the image does
	// not open (a KeyError). The slice is the library's: it clears it
	// once the key is unlocked, and keeps only the master key, which
	// Close clears.
	Passphrase func(file string) []byte

	// KeyCache, if set, remembers the master keys of the LUKS images
	// unlocked, so that opening one again costs no PBKDF2 (keycache.go).
	// Share one between the images of a mount.
	KeyCache *KeyCache

	// Warnf, if set, receives warnings that do not stop the image from
	// opening (a backing file whose format had to be probed, a dirty
	// image, ...).
	Warnf func(format string, args ...any)
}

// DefaultMaxChainDepth is the default limit on the number of backing files
// below an image.
const DefaultMaxChainDepth = 64

// Image is an opened qcow2 image together with its backing chain. It is an
// io.ReaderAt over the virtual disk and is safe for concurrent use.
type Image struct {
	top   *layer
	cache *Cache
	pins  pins // reads and writes in flight, against reuse of freed clusters

	w        *writer // nil unless open for writing (writable.go)
	roReason string  // why Options.Writable could not be honoured

	// locked holds the lock bytes the image holds on its file (lock.go):
	// bit i for byte 100+i, bit 8+i for byte 200+i.
	locked atomic.Uint32

	closeOnce sync.Once
	closeErr  error // Close's result, for every later call

	indexOnce sync.Once
	// idx is made once, on first use (index), and read without that
	// once by writes that invalidate it (invalidate): atomic.
	idx       atomic.Pointer[holeIndex] // see holes.go
	snapshots []Snapshot
	warnf     func(format string, args ...any) // Options.Warnf
}

// Open opens the qcow2 image at path and its whole backing chain, from the
// local file system.
func Open(path string, opts Options) (*Image, error) {
	f, err := OpenFile(path)
	if err != nil {
		return nil, err
	}
	return NewImage(f, opts)
}

// NewImage reads the qcow2 image in f and opens its backing chain through
// opts.Opener. The Image owns f: Close closes it, and so does a failed
// NewImage.
func NewImage(f HostFile, opts Options) (*Image, error) {
	if opts.Cache == nil {
		opts.Cache = NewCache(DefaultCacheSize, DefaultClusterCacheSize)
	}
	if opts.Budget == nil {
		opts.Budget = NewBudget(DefaultBudget)
	}
	if opts.MaxChainDepth <= 0 {
		opts.MaxChainDepth = DefaultMaxChainDepth
	}
	if opts.Opener == nil {
		opts.Opener = &LocalOpener{AllowedDirs: opts.AllowedDirs}
	}
	c := &chain{opts: opts, seen: map[any]string{}}
	if err := c.visit(f); err != nil {
		f.Close()
		return nil, err
	}
	top, err := c.openQcow2(f, 0)
	if err != nil {
		return nil, err
	}
	if top.backing != nil {
		top.backing.index = newChainIndex(top.backing, opts.Cache)
	}
	img := &Image{top: top, cache: opts.Cache, snapshots: top.snapshots, warnf: opts.Warnf}
	if opts.Writable {
		if err := img.openForWriting(c); err != nil {
			img.Close()
			return nil, err
		}
	}
	return img, nil
}

// openForWriting makes img writable, or records why it stays read-only.
func (img *Image) openForWriting(c *chain) error {
	l := img.top
	f, ok := l.file.(WritableFile)
	switch {
	case c.opts.Snapshot != "" || c.opts.SnapshotIndex != 0:
		img.roReason = "a snapshot is read-only"
	case !ok:
		img.roReason = "its file is not open for writing"
	default:
		img.roReason = readOnlyReason(l)
	}
	if img.roReason != "" {
		return nil
	}
	var df WritableFile
	if l.dataFile != nil {
		if df, ok = l.dataFile.(WritableFile); !ok {
			img.roReason = "its data file is not open for writing"
			return nil
		}
	}
	w, err := openWriter(img, f, df)
	if err != nil {
		return err
	}
	img.w = w
	l.writable = true
	l.behind = w.behind
	return nil
}

// Size returns the virtual disk size in bytes.
func (img *Image) Size() int64 { return img.top.vsize() }

// Header returns the image's parsed header. It must not be modified.
func (img *Image) Header() *Header { return img.top.hdr }

// Name returns the name of the image file.
func (img *Image) Name() string { return img.top.name }

// File returns the image file. It must not be closed.
func (img *Image) File() HostFile { return img.top.file }

// Close writes back what a writable image has pending (leaving it clean),
// then closes every file of the chain and drops its cached tables. Only
// the first call does: a later one, or one made meanwhile (an unmount
// closing what a last user is closing), waits for it and returns its
// result.
func (img *Image) Close() error {
	img.closeOnce.Do(func() { img.closeErr = img.close() })
	return img.closeErr
}

func (img *Image) close() error {
	var first error
	if img.w != nil {
		first = img.w.close()
		img.w.closeBitmaps()
	}
	for l := img.top; l != nil; l = l.backing {
		if err := l.close(); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// ReadAt reads len(p) bytes of the virtual disk at off. Like io.ReaderAt,
// it returns io.EOF when the read reaches the end of the disk. Compressed
// clusters of one read are inflated in parallel, on as many goroutines as
// the Cache allows.
func (img *Image) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("%s: negative offset %d", img.top.name, off)
	}
	size := img.top.vsize()
	if off >= size {
		return 0, io.EOF
	}
	want := len(p)
	if int64(len(p)) > size-off {
		p = p[:size-off]
	}
	pin := img.pins.take()
	defer pin.Release()
	// Most reads are one extent (a 4 KiB read of a data cluster, or of
	// one compressed cluster): read it without the machinery below,
	// which costs allocations and has nothing to run in parallel.
	e, err := img.top.extent(off, int64(len(p)), probeNone)
	if err != nil {
		return 0, err
	}
	if e.Length < int64(len(p)) {
		return img.readExtents(p, off, want)
	}
	if err := e.read(p); err != nil {
		return 0, err
	}
	if len(p) < want {
		return len(p), io.EOF
	}
	return len(p), nil
}

// readExtents is ReadAt for a range of several extents or compressed
// clusters, which are inflated in parallel; p is cut at the end of the
// disk, want is what was asked. The caller holds a pin.
func (img *Image) readExtents(p []byte, off int64, want int) (int, error) {
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		firstErr error
		errAt    = len(p)
	)
	fail := func(at int, err error) {
		mu.Lock()
		if at < errAt {
			firstErr, errAt = err, at
		}
		mu.Unlock()
	}
	done := 0
	for done < len(p) {
		e, err := img.top.extent(off+int64(done), int64(len(p)-done), probeNone)
		if err != nil {
			fail(done, err)
			break
		}
		dst := p[done : done+int(e.Length)]
		at := done
		done += int(e.Length)
		if e.Status&StatusCompressed != 0 && done < len(p) {
			// More follows: inflate this one on another goroutine
			// if one is free, else here.
			select {
			case img.cache.inflaters <- struct{}{}:
				wg.Add(1)
				go func() {
					defer func() { <-img.cache.inflaters; wg.Done() }()
					if err := e.read(dst); err != nil {
						fail(at, err)
					}
				}()
				continue
			default:
			}
		}
		if err := e.read(dst); err != nil {
			fail(at, err)
			break
		}
	}
	wg.Wait()
	if firstErr != nil {
		return errAt, firstErr
	}
	if len(p) < want {
		return len(p), io.EOF
	}
	return len(p), nil
}
