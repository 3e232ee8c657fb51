package qcow2

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/qcowfs/qcowfs/fiemap"
)

// The layer: one file of a backing chain, its header and L1 table, and
// its host reads.

// layer is one file of a backing chain: a qcow2 image or a raw file.
// What is set at open stays; what changes says so: the file and data
// file sizes, the virtual size and the L1 table (the writer grows them,
// atomically), the metadata map (the writer publishes new ones), and what
// is built lazily (each behind its Once). The table cache has its own
// locking.
type layer struct {
	name     string       // the file's name, as its HostFile gives it
	file     HostFile     // the image file itself
	meta     metaFile     // metadata reads of file
	fileLen  atomic.Int64 // the file's size: at open, or as the writer grew it
	virtSize atomic.Int64 // virtual size in bytes (a resize changes it)
	depth    int          // 0 for the top image
	backing  *layer
	// index: which layer from this one down decides each granule
	// (chainindex.go); set on the top image's backing file of a deep
	// chain, nil otherwise.
	index *chainIndex

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
	budget        *charge                          // memory held for this file's structures (budget.go)
	warnf         func(format string, args ...any) // Options.Warnf; may be nil

	// Read lazily, each guarded by its Once.
	refs         refcounts
	preallocOnce sync.Once
	prealloc     bool // see metadataPreallocated
	hostOnce     sync.Once
	host         atomic.Pointer[fiemap.Map] // holes of the data file; nil if unknown

	// Compressed clusters (compress.go).
	comp compressedReads
	// crypt: an encrypted layer's cipher (encrypt.go); nil if the layer
	// is not encrypted.
	crypt *layerCrypt

	// The metadata map (metadata.go), built on first use.
	metaOnce sync.Once
	metaMap  atomic.Pointer[MetadataMap] // replaced as a whole by the writer
	metaErr  error
}

// close releases what one layer holds: its cached tables and clusters, its
// host-hole map and readahead buffer, and its files.
func (l *layer) close() error {
	if l.index != nil {
		l.index.close()
	}
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
	if ra := l.comp.ra.Load(); ra != nil {
		ra.Close()
	}
	if l.crypt != nil {
		l.crypt.c.Close()
	}
	first := l.file.Close()
	if l.dataFile != nil {
		if err := l.dataFile.Close(); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// newQcow2Layer reads the header and L1 table of the qcow2 file f. A
// failure gives back whatever the layer took: its memory charge and its
// cipher (whose key it clears). The caller closes f.
func newQcow2Layer(f HostFile, depth int, opts *Options) (_ *layer, err error) {
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
	l.comp.decomp = newDecompressor(h.CompressionType, l.clusterSize())
	defer func() {
		if err != nil {
			l.budget.close()
			if l.crypt != nil {
				l.crypt.c.Close()
			}
		}
	}()
	if h.CryptMethod != cryptNone {
		if err := l.unlock(opts); err != nil {
			return nil, err
		}
	}

	if depth == 0 {
		if l.snapshots, l.snapTableSize, err = readSnapshots(&l.meta, h, l.vsize(), l.budget); err != nil {
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
			return nil, fmt.Errorf("cannot open the snapshot: %w", s.Err)
		}
		l1Off, l1Size = int64(s.L1TableOffset), s.L1Size
		l.virtSize.Store(s.Size)
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
