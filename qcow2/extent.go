package qcow2

import (
	"errors"
	"fmt"
	"io"

	"github.com/qcowfs/qcowfs/fiemap"
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

// HostFile returns the name of the file holding the extent's bytes when
// Offset is meaningful, and "" otherwise.
func (e *Extent) HostFile() string {
	if e.Offset < 0 || e.layer == nil {
		return ""
	}
	return e.layer.data().Name()
}

// Host returns the file descriptor and offset holding the extent's bytes
// when they are stored there as they are (data, not compressed), lie wholly
// inside the file, and the file has a descriptor, so a caller may splice
// them directly. ok is false for everything else: zeros, compressed data, a
// cluster cut short by the end of the file (ReadAt fills its tail with
// zeros), or a host file without a descriptor (a remote object).
func (e *Extent) Host() (fd uintptr, off int64, ok bool) {
	if e.layer == nil || e.Status&(StatusData|StatusCompressed) != StatusData ||
		e.Offset < 0 || e.Offset+e.Length > e.layer.dataSize() || e.layer.crypt != nil {
		return 0, 0, false
	}
	f, isFd := e.layer.data().(fdFile)
	if !isFd {
		return 0, 0, false
	}
	return f.Fd(), e.Offset, true
}

// Extent returns the extent that starts at off and is at most length bytes
// long, as qemu's block status reports it (`qemu-img map`): raw backing
// files are asked where their holes are, and so are the data clusters of
// images made with preallocation=metadata; other data clusters are data.
// It reads at most one L2 table per layer of the chain, so walking a disk
// extent by extent costs O(1) per extent after the tables are cached.
func (img *Image) Extent(off, length int64) (Extent, error) {
	if off < 0 || off >= img.top.vsize() || length <= 0 {
		return Extent{}, fmt.Errorf("%s: extent [%d, +%d) outside the disk (%d bytes)", img.top.name, off, length, img.top.vsize())
	}
	e, err := img.top.extent(off, min(length, img.top.vsize()-off), probeQemu)
	if err == nil && e.layer != nil && e.Status&(StatusData|StatusCompressed) == StatusData && e.Offset >= 0 {
		// The caller reads its host bytes next (Host): a write in
		// flight there lands first.
		e.layer.behind.wait(e.Offset, e.Offset+e.Length)
	}
	return e, err
}

// probe says when extent asks a host file where its holes are.
type probe uint8

const (
	// probeNone: never (reads: a hole reads as zeros anyway).
	probeNone probe = iota
	// probeQemu: where qemu does: raw layers, and data clusters of
	// metadata-preallocated images.
	probeQemu
	// probeAll: every uncompressed data range, so that clusters qcow2
	// calls allocated but the host never wrote count as holes.
	probeAll
)

// extent resolves [off, off+n) from this layer downwards; off < l.vsize().
func (l *layer) extent(off, n int64, p probe) (Extent, error) {
	n = min(n, l.vsize()-off)
	if l.raw {
		e := Extent{Start: off, Length: n, Status: StatusData | StatusAllocated,
			Depth: l.depth, Offset: off, layer: l}
		if p != probeNone {
			l.probeHost(&e)
		}
		return e, nil
	}
	r, err := l.lookup(off, n)
	if err != nil {
		return Extent{}, err
	}
	e := Extent{Start: off, Length: r.length, Depth: l.depth, Offset: r.host, layer: l}
	switch r.kind {
	case kindNormal:
		e.Status = StatusData | StatusAllocated
		// (Host holes are cached, so not asked of a file the writer
		// changes: its allocated clusters count as data.)
		if !l.writable && l.crypt == nil && (p == probeAll || p == probeQemu && l.metadataPreallocated()) {
			l.probeHost(&e)
		}
	case kindZero:
		e.Status = StatusZero | StatusAllocated
	case kindCompressed:
		e.Status = StatusData | StatusAllocated | StatusCompressed
		e.Offset = -1
		e.entry, e.entryOff = r.entry, r.entryOff
	case kindUnallocated:
		b := l.backing
		if b == nil || off >= b.vsize() {
			// No backing file, or past the end of a shorter one:
			// zeros, decided by this layer (with the host offset of
			// an allocated cluster's unallocated subcluster, as
			// qemu reports it).
			e.Status = StatusZero
			return e, nil
		}
		if x := b.index; x != nil {
			return x.extent(off, r.length, p)
		}
		return b.extent(off, r.length, p)
	}
	return e, nil
}

// hostMap returns the extent map of the layer's data file, made on first
// use; nil if the file cannot be mapped (then everything is data).
func (l *layer) hostMap() *fiemap.Map {
	l.hostOnce.Do(func() {
		// Sync: dirty pages in the image (qemu just wrote it) are
		// written back first, so an unwritten extent is a hole for sure
		// and answers do not depend on what the page cache holds.
		f := fileOf(l.data())
		if f == nil {
			return // not a local file: everything is data
		}
		if m, err := fiemap.New(f, &fiemap.Options{Sync: true}); err == nil {
			l.host.Store(m)
		}
	})
	return l.host.Load()
}

// probeHost trims a data extent to its first piece that is uniformly data
// or hole in the host file, and marks a hole as reading zeros: for a raw
// layer it is then a zero extent, as qemu's file driver says; for a qcow2
// cluster it stays "data" too, as qemu reports (an allocated cluster whose
// host bytes read as zeros).
func (l *layer) probeHost(e *Extent) {
	m := l.hostMap()
	if m == nil {
		return
	}
	d, err := m.NextData(e.Offset)
	switch {
	case err == nil && d == e.Offset:
		if h, err := m.NextHole(e.Offset); err == nil && h > e.Offset {
			e.Length = min(e.Length, h-e.Offset)
		}
		return
	case err == nil:
		e.Length = min(e.Length, d-e.Offset)
	case !errors.Is(err, io.EOF):
		return // cannot tell: data
	}
	e.Status |= StatusZero
	if l.raw {
		e.Status &^= StatusData
	}
}

// read fills p (len(p) == e.Length) with the extent's bytes.
func (e *Extent) read(p []byte) error {
	switch {
	case e.Status&StatusCompressed != 0:
		return e.layer.readCompressed(p, e.Start, e.entry, e.entryOff)
	case e.Status&StatusData != 0 && e.layer.crypt != nil:
		return e.layer.readDecrypted(p, e.Offset, e.Start)
	case e.Status&StatusData != 0:
		return e.layer.readHost(p, e.Offset)
	default:
		clear(p)
		return nil
	}
}
