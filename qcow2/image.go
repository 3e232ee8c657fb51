package qcow2

import (
	"fmt"
	"io"
	"sync"
	"sync/atomic"

	"github.com/qcowfs/qcowfs/fiemap"
	"github.com/qcowfs/qcowfs/readahead"
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

	indexOnce sync.Once
	idx       *holeIndex // see holes.go
	snapshots []Snapshot
	warnf     func(format string, args ...any) // Options.Warnf
}

// layer is one file of a backing chain: a qcow2 image or a raw file.
// Everything in a layer is set at open and read-only afterwards, except
// the cache, which has its own locking, and what is built lazily.
type layer struct {
	name     string       // the file's name, as its HostFile gives it
	file     HostFile     // the image file itself
	meta     metaFile     // metadata reads of file
	fileLen  atomic.Int64 // the file's size: at open, or as the writer grew it
	virtSize atomic.Int64 // virtual size in bytes (a resize changes it)
	depth    int          // 0 for the top image
	backing  *layer

	// Set for raw layers only.
	raw bool
	// writable: the writer changes this layer (the top one), so host
	// holes of its files are not cached.
	writable bool
	// behind: the writer's data writes in flight (behind.go); nil for a
	// layer that is not written.
	behind *behind

	// Set for qcow2 layers only.
	hdr           *Header
	dataFile      HostFile     // external data file; nil when clusters live in file
	dataLen       atomic.Int64 // the data file's size (the writer grows it)
	clusterBits   uint
	l2Bits        uint // log2 of entries per L2 table
	scBits        uint // log2 of the subcluster size (= clusterBits without extended L2)
	extendedL2    bool
	l1            atomic.Pointer[l1Table] // the header's or a snapshot's
	snapshots     []Snapshot              // the top layer's snapshot table
	snapTableSize int64                   // and its size in bytes
	cache         *Cache
	owner         uint64
	decomp        *decompressor
	budget        *charge                          // memory held for this file's structures (budget.go)
	warnf         func(format string, args ...any) // Options.Warnf; may be nil

	// Read lazily, each guarded by its Once.
	refs         refcounts
	preallocOnce sync.Once
	prealloc     bool // see metadataPreallocated
	hostOnce     sync.Once
	host         atomic.Pointer[fiemap.Map] // holes of the data file; nil if unknown

	// Compressed clusters (compress.go).
	raOnce      sync.Once
	ra          atomic.Pointer[readahead.Reader] // host reads of compressed data
	lastCluster atomic.Int64                     // guest cluster of the last partial read
	prefetching atomic.Bool                      // a readAhead goroutine is running
	inflates    atomic.Int64                     // compressed clusters inflated

	// The metadata map (metadata.go), built on first use.
	metaOnce sync.Once
	metaMap  atomic.Pointer[MetadataMap] // replaced as a whole by the writer
	metaErr  error
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

// Pin keeps the host clusters a caller is about to find with Extent (and
// read or splice from their host files) from being reused for other data
// by a concurrent write, until Release. ReadAt pins by itself.
func (img *Image) Pin() Pin { return img.pins.take() }

// Size returns the virtual disk size in bytes.
func (img *Image) Size() int64 { return img.top.vsize() }

// Header returns the image's parsed header. It must not be modified.
func (img *Image) Header() *Header { return img.top.hdr }

// Name returns the name of the image file.
func (img *Image) Name() string { return img.top.name }

// File returns the image file. It must not be closed.
func (img *Image) File() HostFile { return img.top.file }

// Close writes back what a writable image has pending (leaving it clean),
// then closes every file of the chain and drops its cached tables.
func (img *Image) Close() error {
	var first error
	if img.w != nil {
		first = img.w.close()
	}
	for l := img.top; l != nil; l = l.backing {
		if err := l.close(); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// close releases what one layer holds: its cached tables and clusters, its
// host-hole map and readahead buffer, and its files.
func (l *layer) close() error {
	if l.owner != 0 {
		l.cache.drop(l.owner)
		l.cache.clusters.drop(l.owner)
	}
	if m := l.host.Load(); m != nil {
		m.Close()
	}
	if l.budget != nil {
		l.budget.close()
	}
	if ra := l.ra.Load(); ra != nil {
		ra.Close()
	}
	first := l.file.Close()
	if l.dataFile != nil {
		if err := l.dataFile.Close(); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// newQcow2Layer reads the header and L1 table of the qcow2 file f.
func newQcow2Layer(f HostFile, depth int, opts *Options) (*layer, error) {
	name := f.Name()
	size, err := f.Size()
	if err != nil {
		return nil, err
	}
	h, err := readHeader(f, size)
	if err != nil {
		return nil, err
	}
	if h.IncompatibleFeatures&IncompatCorrupt != 0 && !opts.AllowCorrupt {
		return nil, &UnsupportedError{File: name, Feature: "corrupt bit set: qemu found the image inconsistent (--allow-corrupt reads it anyway)"}
	}
	l := &layer{
		name:        name,
		file:        f,
		meta:        metaFile{f: f, size: size, clusterSize: h.ClusterSize()},
		depth:       depth,
		hdr:         h,
		clusterBits: uint(h.ClusterBits),
		extendedL2:  h.ExtendedL2(),
		cache:       opts.Cache,
		owner:       opts.Cache.newOwner(),
		budget:      newCharge(opts.Budget, name),
		warnf:       opts.Warnf,
	}
	l.fileLen.Store(size)
	l.virtSize.Store(virtualSize(h.Size))
	l.scBits = l.clusterBits
	if l.extendedL2 {
		l.scBits = l.clusterBits - 5
	}
	l.l2Bits = l.clusterBits - uint(l.l2EntryBits())
	l.decomp = newDecompressor(h.CompressionType, l.clusterSize())

	if depth == 0 {
		if l.snapshots, l.snapTableSize, err = readSnapshots(&l.meta, h, l.vsize(), l.budget); err != nil {
			l.budget.close()
			return nil, err
		}
	}
	l1Off, l1Size := int64(h.L1TableOffset), h.L1Size
	if depth == 0 && (opts.Snapshot != "" || opts.SnapshotIndex != 0) {
		var s *Snapshot
		switch i := opts.SnapshotIndex - 1; {
		case i >= 0 && i < len(l.snapshots):
			s = &l.snapshots[i]
		case i >= 0:
			return nil, fmt.Errorf("%s: no snapshot at index %d (the table has %d)", name, i, len(l.snapshots))
		default:
			var ok bool
			if s, ok = findSnapshot(l.snapshots, opts.Snapshot); !ok {
				return nil, fmt.Errorf("%s: no snapshot with ID or name %q", name, opts.Snapshot)
			}
		}
		if s.Err != nil {
			l.budget.close()
			return nil, fmt.Errorf("cannot open the snapshot: %w", s.Err)
		}
		l1Off, l1Size = int64(s.L1TableOffset), s.L1Size
		l.virtSize.Store(s.Size)
	}
	if err := l.loadL1(l1Off, l1Size, !opts.LenientTables); err != nil {
		l.budget.close()
		return nil, err
	}
	return l, nil
}

// loadL1 reads the L1 table of l1Size entries at l1Off (the header or
// snapshot check has put it inside the file, within maxL1Bytes) and checks
// every entry: an L2 table offset must be cluster aligned and its table
// inside the file, so that a bad entry is refused at open rather than
// found by a read.
func (l *layer) loadL1(l1Off int64, l1Size uint32, check bool) error {
	if err := l.budget.add(int64(l1Size)*8, "L1 table"); err != nil {
		return err
	}
	entries, err := l.meta.words(l1Off, int64(l1Size), "L1 table")
	if err != nil {
		return err
	}
	t := &l1Table{off: l1Off, entries: entries}
	if check {
		for i := range t.len() {
			if err := l.checkL1Entry(t, i); err != nil {
				return err
			}
		}
	}
	l.l1.Store(t)
	return nil
}

// checkL1Entry checks that entry i of t points to an L2 table that is
// cluster aligned and lies inside the file.
func (l *layer) checkL1Entry(t *l1Table, i int64) error {
	e := t.entry(i)
	off := e.l2Offset()
	if off == 0 {
		return nil
	}
	cs := l.clusterSize()
	if off&(cs-1) != 0 {
		return &FormatError{File: l.name, Field: "L1 entry", Value: uint64(e), Offset: t.off + 8*i,
			Msg: fmt.Sprintf("L2 table offset %#x is not cluster aligned", off)}
	}
	if off > l.fsize()-cs {
		return &FormatError{File: l.name, Field: "L1 entry", Value: uint64(e), Offset: t.off + 8*i,
			Msg: fmt.Sprintf("L2 table at %#x runs past the end of the file (%d bytes)", off, l.fsize())}
	}
	return nil
}

func (l *layer) clusterSize() int64 { return 1 << l.clusterBits }

// vsize is the layer's virtual size.
func (l *layer) vsize() int64 { return l.virtSize.Load() }

// fsize is the size of the layer's file.
func (l *layer) fsize() int64 { return l.fileLen.Load() }

// setFileSize records that the writer grew the file.
func (l *layer) setFileSize(n int64) { l.fileLen.Store(n) }

// l2EntryBits is log2 of the size of one L2 entry in bytes: 4 (16 bytes)
// with extended L2 entries, else 3.
func (l *layer) l2EntryBits() int {
	if l.extendedL2 {
		return 4
	}
	return 3
}

// l2EntryWords is the size of one L2 entry in 64-bit words: 2 with
// extended L2 entries (the entry and its subcluster bitmap), else 1.
func (l *layer) l2EntryWords() int { return 1 << (l.l2EntryBits() - 3) }

// external reports whether the layer's clusters live in an external data
// file.
func (l *layer) external() bool { return l.dataFile != nil }

// dataSize is the size of the file holding the layer's clusters.
func (l *layer) dataSize() int64 {
	if l.dataFile != nil {
		return l.dataLen.Load()
	}
	return l.fsize()
}

// data returns the file holding the layer's clusters.
func (l *layer) data() HostFile {
	if l.dataFile != nil {
		return l.dataFile
	}
	return l.file
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

// read fills p (len(p) == e.Length) with the extent's bytes.
func (e *Extent) read(p []byte) error {
	switch {
	case e.Status&StatusCompressed != 0:
		return e.layer.readCompressed(p, e.Start, e.entry, e.entryOff)
	case e.Status&StatusData != 0:
		return e.layer.readHost(p, e.Offset)
	default:
		clear(p)
		return nil
	}
}

// readHost reads p from the layer's data file at host offset off. Like
// qemu's file driver, bytes of a cluster that lie past the end of the file
// (as it was at open) read as zeros; a run that starts past the end is
// corruption, caught by lookup. Everything before that end must be read:
// a file that shrank since is an error, not a reason to serve whatever the
// buffer held.
func (l *layer) readHost(p []byte, off int64) error {
	l.behind.wait(off, off+int64(len(p)))
	f, size := l.data(), l.dataSize()
	n := len(p)
	if off >= size {
		n = 0
	} else if int64(n) > size-off {
		n = int(size - off)
	}
	if n > 0 {
		if err := readFull(f, p[:n], off, "guest data"); err != nil {
			return err
		}
	}
	clear(p[n:])
	return nil
}
