package qcow2

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"

	"github.com/qcowfs/qcowfs/fiemap"
	"github.com/qcowfs/qcowfs/readahead"
)

// Options configure Open. The zero value is usable.
type Options struct {
	// Cache holds L2 tables. Share one Cache between all images of a
	// mount to bound the memory of all of them together. Nil means a
	// private cache of DefaultCacheSize bytes.
	Cache *Cache

	// AllowedDirs confines backing and data files: when non-empty, a
	// referenced file must resolve (after symlinks) to a path inside one
	// of these folders, or Open fails with ErrRefused.
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

	// LenientTables skips checking every L1 entry at open, for image
	// checkers that report bad entries rather than refuse the image.
	// Reads through a bad entry still fail.
	LenientTables bool

	// AllowCorrupt opens images whose corrupt bit is set. They are only
	// ever read, so this cannot make them worse.
	AllowCorrupt bool

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

	indexOnce sync.Once
	idx       *statusIndex // see status.go
	snapshots []Snapshot
}

// layer is one file of a backing chain: a qcow2 image or a raw file.
// Everything in a layer is set at open and read-only afterwards, except
// the cache, which has its own locking.
type layer struct {
	name     string   // path as opened (relative to the caller's cwd)
	file     *os.File // the image file itself
	fileSize int64
	size     int64 // virtual size in bytes
	depth    int   // 0 for the top image
	backing  *layer

	// Set for raw layers only.
	raw bool

	// Set for qcow2 layers only.
	hdr           *Header
	dataFile      *os.File // external data file; nil when clusters live in file
	dataFileSize  int64
	clusterBits   uint
	l2Bits        uint // log2 of entries per L2 table
	scBits        uint // log2 of the subcluster size (= clusterBits without extended L2)
	extendedL2    bool
	l1            []uint64
	l1Offset      int64      // where l1 was read from: the header's or a snapshot's
	snapshots     []Snapshot // the top layer's snapshot table
	snapTableSize int64      // and its size in bytes
	cache         *Cache
	owner         uint64
	decomp        *decompressor

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
	meta     *MetadataMap
	metaErr  error
}

// Open opens the qcow2 image at path and its whole backing chain.
func Open(path string, opts Options) (*Image, error) {
	if opts.Cache == nil {
		opts.Cache = NewCache(DefaultCacheSize, DefaultClusterCacheSize)
	}
	if opts.MaxChainDepth <= 0 {
		opts.MaxChainDepth = DefaultMaxChainDepth
	}
	o := &opener{opts: opts, seen: map[fileID]string{}}
	top, err := o.openQcow2(path, 0)
	if err != nil {
		return nil, err
	}
	return &Image{top: top, cache: opts.Cache, snapshots: top.snapshots}, nil
}

// Size returns the virtual disk size in bytes.
func (img *Image) Size() int64 { return img.top.size }

// Header returns the image's parsed header. It must not be modified.
func (img *Image) Header() *Header { return img.top.hdr }

// Name returns the path the image was opened with.
func (img *Image) Name() string { return img.top.name }

// File returns the image file. It must not be closed or written.
func (img *Image) File() *os.File { return img.top.file }

// Close closes every file of the chain and drops its cached tables.
func (img *Image) Close() error {
	var first error
	for l := img.top; l != nil; l = l.backing {
		if l.owner != 0 {
			img.cache.drop(l.owner)
		}
		if m := l.host.Load(); m != nil {
			m.Close()
		}
		if ra := l.ra.Load(); ra != nil {
			ra.Close()
		}
		if l.owner != 0 {
			img.cache.clusters.drop(l.owner)
		}
		if err := l.file.Close(); err != nil && first == nil {
			first = err
		}
		if l.dataFile != nil {
			if err := l.dataFile.Close(); err != nil && first == nil {
				first = err
			}
		}
	}
	return first
}

// newQcow2Layer reads the header and L1 table of the qcow2 file f.
func newQcow2Layer(f *os.File, name string, depth int, opts *Options) (*layer, error) {
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	h, err := readHeader(f, name, st.Size())
	if err != nil {
		return nil, err
	}
	if h.IncompatibleFeatures&IncompatCorrupt != 0 && !opts.AllowCorrupt {
		return nil, &UnsupportedError{File: name, Feature: "corrupt bit set: qemu found the image inconsistent (--allow-corrupt reads it anyway)"}
	}
	l := &layer{
		name:        name,
		file:        f,
		fileSize:    st.Size(),
		size:        int64(h.Size),
		depth:       depth,
		hdr:         h,
		clusterBits: uint(h.ClusterBits),
		extendedL2:  h.ExtendedL2(),
		cache:       opts.Cache,
		owner:       opts.Cache.newOwner(),
	}
	entryBits := uint(3)
	l.scBits = l.clusterBits
	if l.extendedL2 {
		entryBits = 4
		l.scBits = l.clusterBits - 5
	}
	l.l2Bits = l.clusterBits - entryBits
	l.decomp = newDecompressor(h.CompressionType, l.clusterSize())

	if depth == 0 {
		if l.snapshots, l.snapTableSize, err = readSnapshots(f, name, h, l.fileSize); err != nil {
			return nil, err
		}
	}
	l1Off, l1Size := int64(h.L1TableOffset), h.L1Size
	if opts.Snapshot != "" && depth == 0 {
		s, ok := findSnapshot(l.snapshots, opts.Snapshot)
		if !ok {
			return nil, fmt.Errorf("%s: no snapshot with ID or name %q", name, opts.Snapshot)
		}
		l1Off, l1Size, l.size = int64(s.L1TableOffset), s.L1Size, s.Size
	}
	if err := l.loadL1(l1Off, l1Size, !opts.LenientTables); err != nil {
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
	buf := make([]byte, int(l1Size)*8)
	if _, err := l.file.ReadAt(buf, l1Off); err != nil {
		return fmt.Errorf("%s: reading L1 table at byte offset %d: %w", l.name, l1Off, err)
	}
	cs := l.clusterSize()
	l.l1 = make([]uint64, l1Size)
	l.l1Offset = l1Off
	for i := range l.l1 {
		e := binary.BigEndian.Uint64(buf[i*8:])
		l.l1[i] = e
		off := int64(e & l1OffsetMask)
		if off == 0 || !check {
			continue
		}
		if off&(cs-1) != 0 {
			return &FormatError{File: l.name, Field: "L1 entry", Value: e, Offset: l1Off + int64(i)*8,
				Msg: fmt.Sprintf("L2 table offset %#x is not cluster aligned", off)}
		}
		if off > l.fileSize-cs {
			return &FormatError{File: l.name, Field: "L1 entry", Value: e, Offset: l1Off + int64(i)*8,
				Msg: fmt.Sprintf("L2 table at %#x runs past the end of the file (%d bytes)", off, l.fileSize)}
		}
	}
	return nil
}

func (l *layer) clusterSize() int64 { return 1 << l.clusterBits }

// dataSize is the size of the file holding the layer's clusters.
func (l *layer) dataSize() int64 {
	if l.dataFile != nil {
		return l.dataFileSize
	}
	return l.fileSize
}

// data returns the file holding the layer's clusters.
func (l *layer) data() *os.File {
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
	size := img.top.size
	if off >= size {
		return 0, io.EOF
	}
	want := len(p)
	if int64(len(p)) > size-off {
		p = p[:size-off]
	}
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
// read as zeros; a run that starts past the end is corruption, caught by
// lookup.
func (l *layer) readHost(p []byte, off int64) error {
	f, size := l.data(), l.dataSize()
	n := len(p)
	if off >= size {
		n = 0
	} else if int64(n) > size-off {
		n = int(size - off)
	}
	if n > 0 {
		if _, err := f.ReadAt(p[:n], off); err != nil && !errors.Is(err, io.EOF) {
			return fmt.Errorf("%s: reading %d bytes at byte offset %d: %w", f.Name(), n, off, err)
		}
	}
	clear(p[n:])
	return nil
}
