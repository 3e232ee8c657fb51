package qcow2

import (
	"bytes"
	"compress/flate"
	"encoding/binary"
	"fmt"
	"io"
	"sync"
	"sync/atomic"

	"github.com/klauspost/compress/zstd"

	"github.com/qcowfs/qcowfs/readahead"
)

// Compressed clusters (specification, "Compressed Clusters Descriptor").
//
// A compressed L2 entry holds, with x = 62 - (cluster_bits - 8):
//
//	bits 0..x-1:  host offset of the compressed data (any byte offset)
//	bits x..61:   number of additional 512-byte sectors it spans
//
// The compressed data ends somewhere in its last sector, and that sector is
// shared with the next compressed cluster. "zlib" compression is raw
// deflate without the zlib header; zstd is a zstd frame. Decompression
// stops once a full cluster is produced: what follows is garbage.
//
// How they are read: the host reads go through a readahead.Reader per
// layer, which turns a sequential scan's many small adjacent reads into a
// few large ones. A read covering a whole cluster inflates straight into
// the caller's buffer; a partial read goes through the Cache's
// decompressed-cluster cache, so the cluster is inflated once for all the
// reads inside it. A read spanning several compressed clusters inflates
// them in parallel, and a sequential run of partial reads has the next
// clusters inflated ahead of it in the background. Decoder state and
// buffers come from pools.

// compressedRange decodes the host byte range of a compressed entry.
func (l *layer) compressedRange(e l2Entry) (off, size int64) { return e.compressedRange(l.clusterBits) }

// checkCompressed fails when the compressed stream of entry e (found at
// entryOff) lies past the end of the file or in the image's metadata.
func (l *layer) checkCompressed(e l2Entry, entryOff int64) error {
	if l.external() {
		return &FormatError{File: l.name, Field: "L2 entry", Value: e.word, Offset: entryOff,
			Msg: "compressed cluster in an image with an external data file"}
	}
	coff, csize := l.compressedRange(e)
	if coff >= l.fsize() {
		return &FormatError{File: l.name, Field: "L2 entry", Value: e.word, Offset: entryOff,
			Msg: fmt.Sprintf("compressed cluster at byte offset %d is past the end of the file (%d bytes)", coff, l.fsize())}
	}
	return l.checkNotMetadata(coff, min(csize, l.fsize()-coff), e, entryOff)
}

// maxZstdWindow is the largest zstd window a frame of a small cluster
// may declare.
const maxZstdWindow = 2 << 20

// compressedReads is a layer's state for reading compressed clusters.
type compressedReads struct {
	decomp      *decompressor
	raOnce      sync.Once
	ra          atomic.Pointer[readahead.Reader] // host reads of compressed data
	lastCluster atomic.Int64                     // guest cluster of the last partial read
	prefetching atomic.Bool                      // a readAhead goroutine is running
	inflates    atomic.Int64                     // compressed clusters inflated
}

// decompressor decompresses whole clusters of one layer, reusing decoder
// state and input buffers through pools.
type decompressor struct {
	typ         uint8
	clusterSize int
	inputs      sync.Pool // *[]byte of two clusters: the largest descriptor
	raws        sync.Pool // *rawInflater (libdeflate)
	flates      sync.Pool // compress/flate readers (fallback)
	zstds       sync.Pool // *zstd.Decoder
	libzstds    sync.Pool // *zstdDecoder (libzstd)
}

func newDecompressor(typ uint8, clusterSize int64) *decompressor {
	d := &decompressor{typ: typ, clusterSize: int(clusterSize)}
	d.inputs.New = func() any {
		b := make([]byte, 2*d.clusterSize)
		return &b
	}
	return d
}

// zstdWindow is the largest window a zstd frame may declare.
func (d *decompressor) zstdWindow() uint64 { return uint64(max(2*d.clusterSize, maxZstdWindow)) }

// decompress inflates src into all of dst, one cluster.
func (d *decompressor) decompress(dst, src []byte) error {
	if d.typ == compressionZstd {
		if haveLibzstd && zstdFastFrame(src, len(dst), d.zstdWindow()) {
			z, _ := d.libzstds.Get().(*zstdDecoder)
			if z == nil {
				z = newZstdDecoder()
			}
			if z != nil {
				err := z.decode(dst, src)
				d.libzstds.Put(z)
				if err == nil {
					return nil
				}
			}
		}
		dec, _ := d.zstds.Get().(*zstd.Decoder)
		if dec == nil {
			var err error
			// A frame may declare any window (up to 3.75 TiB); the
			// decoder's memory follows it. One cluster is all a frame
			// may decode to: qemu's frames declare their content
			// size as the window, other encoders up to twice it, or
			// their level's default (2 MiB at most for levels 1-4)
			// when they were not told the size. A frame that declares
			// more is refused (EIO).
			dec, err = zstd.NewReader(nil, zstd.WithDecoderConcurrency(1), zstd.WithDecoderLowmem(true),
				zstd.WithDecoderMaxWindow(d.zstdWindow()))
			if err != nil {
				return err
			}
		}
		defer d.zstds.Put(dec)
		if err := dec.Reset(bytes.NewReader(src)); err != nil {
			return err
		}
		_, err := io.ReadFull(dec, dst)
		return err
	}
	if haveLibdeflate {
		r, _ := d.raws.Get().(*rawInflater)
		if r == nil {
			r = newRawInflater()
		}
		if r != nil {
			err := r.inflate(dst, src)
			d.raws.Put(r)
			if err == nil {
				return nil
			}
			// Streams libdeflate does not decode exactly to one cluster
			// (longer ones, say) are left to compress/flate, which
			// stops at a full cluster as qemu's zlib does.
		}
	}
	fr, _ := d.flates.Get().(io.ReadCloser)
	if fr == nil {
		fr = flate.NewReader(bytes.NewReader(src))
	} else if err := fr.(flate.Resetter).Reset(bytes.NewReader(src), nil); err != nil {
		return err
	}
	defer d.flates.Put(fr)
	_, err := io.ReadFull(fr, dst)
	return err
}

// zstdFastFrame reports whether src starts with the zstd frame libzstd
// decodes for us (inflate_libzstd.go): no dictionary, a content size of
// exactly size bytes, and a window of at most window bytes (the bound the
// stream decoder applies: a frame over it is refused there). Any other
// frame goes to the stream decoder.
func zstdFastFrame(src []byte, size int, window uint64) bool {
	const magic = 0xFD2FB528
	if len(src) < 6 || binary.LittleEndian.Uint32(src) != magic {
		return false
	}
	desc := src[4]
	single := desc&0x20 != 0
	if desc&0x08 != 0 { // reserved
		return false
	}
	pos := 5
	var win uint64
	if !single {
		wd := src[pos]
		pos++
		base := uint64(1) << (10 + wd>>3)
		win = base + base/8*uint64(wd&7)
	}
	if n := [4]int{0, 1, 2, 4}[desc&3]; n > 0 { // a dictionary ID: 0 is none
		if len(src) < pos+n {
			return false
		}
		for _, b := range src[pos : pos+n] {
			if b != 0 {
				return false
			}
		}
		pos += n
	}
	var fcs uint64
	switch desc >> 6 {
	case 0:
		if !single || len(src) < pos+1 {
			return false // no content size
		}
		fcs = uint64(src[pos])
	case 1:
		if len(src) < pos+2 {
			return false
		}
		fcs = uint64(binary.LittleEndian.Uint16(src[pos:])) + 256
	case 2:
		if len(src) < pos+4 {
			return false
		}
		fcs = uint64(binary.LittleEndian.Uint32(src[pos:]))
	case 3:
		if len(src) < pos+8 {
			return false
		}
		fcs = binary.LittleEndian.Uint64(src[pos:])
	}
	if single {
		win = fcs
	}
	return fcs == uint64(size) && win <= window
}

// compressedReader returns the readahead reader for compressed data of
// this layer, made on first use.
func (l *layer) compressedReader() *readahead.Reader {
	l.comp.raOnce.Do(func() {
		l.comp.ra.Store(readahead.New(l.file, readahead.Options{MaxWindow: 2 << 20, MaxStreams: 4}))
	})
	return l.comp.ra.Load()
}

// inflate decompresses the compressed cluster e (found at entryOff) into
// dst, one cluster long.
func (l *layer) inflate(dst []byte, e l2Entry, entryOff int64) error {
	// The stream must lie in the file, and not in the image's own
	// metadata (block status reports the cluster as data, as qemu does;
	// reading it is what must not hand metadata out).
	if err := l.checkCompressed(e, entryOff); err != nil {
		return err
	}
	coff, csize := l.compressedRange(e)
	// The last sector may be cut short by the end of the file, as qemu
	// writes it; the compressed stream itself must still be complete.
	csize = min(csize, l.fsize()-coff)

	d := l.comp.decomp
	bp := d.inputs.Get().(*[]byte)
	defer d.inputs.Put(bp)
	src := (*bp)[:csize]
	if n, err := l.compressedReader().ReadAt(src, coff); n < len(src) {
		// The file shrank since it was opened: never inflate what the
		// pooled buffer held before.
		if err == nil || err == io.EOF {
			err = ErrShortRead
		}
		return fmt.Errorf("%s: reading compressed cluster at byte offset %d (%d bytes, got %d): %w", l.name, coff, len(src), n, err)
	}
	l.comp.inflates.Add(1)
	l.cache.inflating()
	if err := d.decompress(dst, src); err != nil {
		return &FormatError{File: l.name, Field: "L2 entry", Value: e.word, Offset: entryOff,
			Msg: fmt.Sprintf("compressed cluster at byte offset %d (%d bytes, %s): %v", coff, csize, l.hdr.CompressionName(), err)}
	}
	return nil
}

// readCompressed fills p with guest bytes starting at guest offset off,
// all inside the compressed cluster described by e (found at entryOff).
func (l *layer) readCompressed(p []byte, off int64, e l2Entry, entryOff int64) error {
	cs := l.clusterSize()
	within := off & (cs - 1)
	if within == 0 && int64(len(p)) == cs {
		return l.inflate(p, e, entryOff)
	}
	coff, _ := l.compressedRange(e)
	ce, err := l.cache.clusters.get(clusterKey{owner: l.owner, off: coff}, int(cs), func(dst []byte) error {
		return l.inflate(dst, e, entryOff)
	})
	if err != nil {
		return err
	}
	copy(p, ce.data()[within:])
	ce.release()
	l.readAhead(off >> l.clusterBits)
	return nil
}

// prefetchDepth is how many clusters are inflated ahead of a sequential
// run of partial reads.
const prefetchDepth = 8

// readAhead notes a partial read of guest cluster g; when it continues a
// sequential run, the next clusters that are compressed in this layer are
// inflated into the cluster cache by background goroutines, as many as
// the Cache's inflater slots allow (a busy Cache skips prefetching).
func (l *layer) readAhead(g int64) {
	last := l.comp.lastCluster.Swap(g)
	if g != last+1 || !l.comp.prefetching.CompareAndSwap(false, true) {
		return
	}
	go func() {
		defer l.comp.prefetching.Store(false)
		cs := l.clusterSize()
		for next := g + 1; next <= g+prefetchDepth && next*cs < l.vsize(); next++ {
			r, err := l.lookup(next*cs, cs)
			if err != nil || r.kind != kindCompressed {
				continue
			}
			coff, _ := l.compressedRange(r.entry)
			k := clusterKey{owner: l.owner, off: coff}
			if l.cache.clusters.contains(k) {
				continue
			}
			select {
			case l.cache.inflaters <- struct{}{}:
			default:
				return // every inflater is busy
			}
			go func() {
				defer func() { <-l.cache.inflaters }()
				ce, err := l.cache.clusters.get(k, int(cs), func(dst []byte) error {
					return l.inflate(dst, r.entry, r.entryOff)
				})
				if err == nil {
					ce.release()
				}
			}()
		}
	}()
}

// Libdeflate reports whether this build inflates deflate-compressed
// clusters with libdeflate (cgo) rather than compress/flate.
func Libdeflate() bool { return haveLibdeflate }
