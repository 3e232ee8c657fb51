package qcow2

import (
	"bytes"
	"compress/flate"
	"fmt"
	"io"
	"sync"

	"github.com/klauspost/compress/zstd"
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

// compressedRange decodes the host byte range of a compressed entry.
func (l *layer) compressedRange(e l2Entry) (off, size int64) {
	x := 62 - (l.clusterBits - 8)
	off = int64(e.word & (1<<x - 1))
	sectors := int64((e.word>>x)&(1<<(l.clusterBits-8)-1)) + 1
	return off, sectors*512 - off&511
}

// decompressor decompresses whole clusters, reusing buffers and decoder
// state between calls through pools.
type decompressor struct {
	typ         uint8
	clusterSize int
	bufs        sync.Pool // *[]byte: compressed input, then the cluster
	flates      sync.Pool // io.ReadCloser that is a flate.Resetter
	zstds       sync.Pool // *zstd.Decoder
}

func newDecompressor(typ uint8, clusterSize int64) *decompressor {
	return &decompressor{typ: typ, clusterSize: int(clusterSize)}
}

// scratch returns a buffer of 3 clusters: up to 2 for compressed input
// (the largest descriptor spans 2 clusters), then 1 for the output.
func (d *decompressor) scratch() *[]byte {
	if b, ok := d.bufs.Get().(*[]byte); ok {
		return b
	}
	b := make([]byte, 3*d.clusterSize)
	return &b
}

// decompress inflates src into dst, which is one cluster long.
func (d *decompressor) decompress(dst, src []byte) error {
	if d.typ == compressionZstd {
		dec, _ := d.zstds.Get().(*zstd.Decoder)
		if dec == nil {
			var err error
			dec, err = zstd.NewReader(nil, zstd.WithDecoderConcurrency(1), zstd.WithDecoderLowmem(true))
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

// readCompressed fills p with guest bytes starting at guest offset off,
// all inside the compressed cluster described by e (found at entryOff).
func (l *layer) readCompressed(p []byte, off int64, e l2Entry, entryOff int64) error {
	if l.dataFile != nil {
		return &FormatError{File: l.name, Field: "L2 entry", Value: e.word, Offset: entryOff,
			Msg: "compressed cluster in an image with an external data file"}
	}
	coff, csize := l.compressedRange(e)
	if coff >= l.fileSize {
		return &FormatError{File: l.name, Field: "L2 entry", Value: e.word, Offset: entryOff,
			Msg: fmt.Sprintf("compressed cluster at byte offset %d is past the end of the file (%d bytes)", coff, l.fileSize)}
	}
	// The last sector may be cut short by the end of the file, as qemu
	// writes it; the deflate stream itself must still be complete.
	csize = min(csize, l.fileSize-coff)

	d := l.decomp
	bp := d.scratch()
	defer d.bufs.Put(bp)
	buf := *bp
	src := buf[:csize]
	dst := buf[2*d.clusterSize:]
	if _, err := l.file.ReadAt(src, coff); err != nil && err != io.EOF {
		return fmt.Errorf("%s: reading compressed cluster at byte offset %d: %w", l.name, coff, err)
	}
	if err := d.decompress(dst, src); err != nil {
		return &FormatError{File: l.name, Field: "L2 entry", Value: e.word, Offset: entryOff,
			Msg: fmt.Sprintf("compressed cluster at byte offset %d (%d bytes, %s): %v", coff, csize, l.hdr.CompressionName(), err)}
	}
	copy(p, dst[off&(l.clusterSize()-1):])
	return nil
}
