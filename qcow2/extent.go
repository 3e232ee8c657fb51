package qcow2

import (
	"fmt"
	"os"
)

// Status describes how a guest range is stored, after qemu's block status
// (BDRV_BLOCK_DATA, BDRV_BLOCK_ZERO, BDRV_BLOCK_ALLOCATED) as printed by
// `qemu-img map --output=json` ("data", "zero", "present").
type Status uint8

const (
	// StatusData: the bytes are stored in some layer of the chain.
	StatusData Status = 1 << iota
	// StatusZero: the range reads as zeros (a zero cluster, unallocated
	// in the whole chain, or past the end of a shorter backing file).
	StatusZero
	// StatusAllocated: some layer of the chain allocates the range
	// (qemu's "present"): data or a zero cluster.
	StatusAllocated
	// StatusCompressed: the bytes are in a compressed cluster.
	StatusCompressed
)

func (s Status) String() string {
	out := ""
	for _, f := range []struct {
		bit  Status
		name string
	}{{StatusData, "data"}, {StatusZero, "zero"}, {StatusAllocated, "allocated"}, {StatusCompressed, "compressed"}} {
		if s&f.bit != 0 {
			if out != "" {
				out += "|"
			}
			out += f.name
		}
	}
	if out == "" {
		return "none"
	}
	return out
}

// An Extent is a range of the virtual disk that is stored the same way,
// resolved through the backing chain.
type Extent struct {
	Start, Length int64 // guest range
	Status        Status
	// Depth is the chain depth of the layer that decided the range: 0 for
	// the image itself, 1 for its backing file, and so on.
	Depth int
	// Offset is the host offset of Start in the file of the layer at Depth
	// (its external data file, if it has one) when that is meaningful: data
	// that is not compressed, and preallocated zero clusters. Otherwise -1.
	Offset int64

	layer    *layer  // the layer at Depth
	entry    l2Entry // compressed extents: the L2 entry
	entryOff int64   // and its byte offset, for error messages
}

// HostFile returns the path of the file holding the extent's bytes when
// Offset is meaningful, and "" otherwise.
func (e *Extent) HostFile() string {
	if e.Offset < 0 || e.layer == nil {
		return ""
	}
	return e.layer.data().Name()
}

// Host returns the host file and offset holding the extent's bytes when
// they are stored there as they are (data, not compressed) and lie wholly
// inside the file, so a caller may read or splice them directly. ok is
// false for everything else: zeros, compressed data, or a cluster cut
// short by the end of the file (ReadAt fills its tail with zeros).
func (e *Extent) Host() (f *os.File, off int64, ok bool) {
	if e.layer == nil || e.Status&(StatusData|StatusCompressed) != StatusData ||
		e.Offset < 0 || e.Offset+e.Length > e.layer.dataSize() {
		return nil, 0, false
	}
	return e.layer.data(), e.Offset, true
}

// Extent returns the extent that starts at off and is at most length bytes
// long. It reads at most one L2 table per layer of the chain, so walking a
// disk extent by extent costs O(1) per extent after the tables are cached.
func (img *Image) Extent(off, length int64) (Extent, error) {
	if off < 0 || off >= img.top.size || length <= 0 {
		return Extent{}, fmt.Errorf("%s: extent [%d, +%d) outside the disk (%d bytes)", img.top.name, off, length, img.top.size)
	}
	length = min(length, img.top.size-off)
	return img.top.extent(off, length)
}

// extent resolves [off, off+n) from this layer downwards; off < l.size.
func (l *layer) extent(off, n int64) (Extent, error) {
	n = min(n, l.size-off)
	if l.raw {
		return Extent{Start: off, Length: n, Status: StatusData | StatusAllocated,
			Depth: l.depth, Offset: off, layer: l}, nil
	}
	r, err := l.lookup(off, n)
	if err != nil {
		return Extent{}, err
	}
	e := Extent{Start: off, Length: r.length, Depth: l.depth, Offset: r.host, layer: l}
	switch r.kind {
	case kindNormal:
		e.Status = StatusData | StatusAllocated
	case kindZero:
		e.Status = StatusZero | StatusAllocated
	case kindCompressed:
		e.Status = StatusData | StatusAllocated | StatusCompressed
		e.Offset = -1
		e.entry, e.entryOff = r.entry, r.entryOff
	case kindUnallocated:
		b := l.backing
		if b == nil || off >= b.size {
			// No backing file, or past the end of a shorter one:
			// zeros, decided by this layer.
			e.Status = StatusZero
			e.Offset = -1
			return e, nil
		}
		return b.extent(off, r.length)
	}
	return e, nil
}
