package qcow2

import "context"

// A HostRange is a range of bytes of one file of an image's chain.
type HostRange struct {
	File     HostFile
	Off, Len int64
	// Metadata: the header and tables of a qcow2 layer (its metadata
	// map: L1 and L2 tables, refcounts, snapshots, bitmaps); else guest
	// data, stored or compressed.
	Metadata bool
}

// HostRanges calls fn with the byte ranges of the chain's files that
// reading the whole disk needs and nothing else: every qcow2 layer's
// metadata (MetadataMap), top first, then, walking the disk in guest
// order, the host bytes of each extent of data, in the file of the layer
// that holds it (an uncompressed cluster as stored, a compressed one its
// compressed bytes). Zero and unallocated ranges need nothing, and neither
// do host clusters that nothing names (freed by a discard, leaked).
// Consecutive ranges of one file that touch are merged. A caller that
// copies these ranges of each file, and nothing else, can read the disk
// from the copies: what fetching a remote image ahead of its readers
// (hydration) relies on. It stops with ctx's error when ctx is done.
func (img *Image) HostRanges(ctx context.Context, fn func(HostRange) error) error {
	var cur HostRange
	emit := func(r HostRange) error {
		if r.Len <= 0 {
			return nil
		}
		if cur.Len > 0 && cur.File == r.File && cur.Metadata == r.Metadata && cur.Off+cur.Len == r.Off {
			cur.Len += r.Len
			return nil
		}
		if cur.Len > 0 {
			if err := fn(cur); err != nil {
				return err
			}
		}
		cur = r
		return nil
	}
	for l := img.top; l != nil; l = l.backing {
		if l.raw {
			continue
		}
		m, err := l.metadata()
		if err != nil {
			return err
		}
		for _, r := range m.Ranges() {
			if err := emit(HostRange{File: l.file, Off: r.Start, Len: r.End - r.Start, Metadata: true}); err != nil {
				return err
			}
		}
	}
	size := img.Size()
	for off, n := int64(0), 0; off < size; n++ {
		if n&1023 == 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		e, err := img.top.extent(off, size-off, probeNone)
		if err != nil {
			return err
		}
		off += e.Length
		if e.layer == nil || e.Status&StatusData == 0 {
			continue
		}
		r := HostRange{File: e.layer.data(), Off: e.Offset, Len: e.Length}
		if e.Status&StatusCompressed != 0 {
			r.Off, r.Len = e.layer.compressedRange(e.entry)
		}
		// A cluster cut short by the end of its file reads its tail as
		// zeros: only the bytes the file has are needed.
		if end := e.layer.dataSize(); r.Off+r.Len > end {
			r.Len = end - r.Off
		}
		if err := emit(r); err != nil {
			return err
		}
	}
	if cur.Len > 0 {
		return fn(cur)
	}
	return nil
}
