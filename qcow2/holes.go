package qcow2

import (
	"sort"
	"sync"
	"sync/atomic"
)

// Holes: the answers to lseek(SEEK_DATA) and lseek(SEEK_HOLE).
//
// A guest range is a hole when it reads as zeros without any layer storing
// those zeros: unallocated in the whole chain, a zero cluster (plain or
// preallocated) in the first layer that has it, past the end of a shorter
// backing file, or a data range whose host bytes are a hole of the host
// file (preallocation=metadata or =falloc images, raw backing files).
// Everything else, compressed clusters included, is data.
//
// Answers come from a cached index. The disk is cut into chunks, each the
// guest span of one L2 table of the image (at least 64 MiB); a chunk's
// entry is the sorted list of its data runs, built on first use by walking
// its extents through the chain. So one lseek costs a binary search once
// its chunk is built, and a forward walk of the disk costs O(chunks +
// extents). The index holds at most a budget of runs (CLOCK eviction of
// whole chunks), so its memory is bounded whatever the disk size; opening
// an image builds nothing.

const (
	chunkMinBits = 26 // 64 MiB
	// indexBudget bounds the memory of one image's index: 1 MiB, 64Ki
	// runs of 16 bytes.
	indexBudget = 1 << 20
)

// dataRun is a range of guest bytes that holds data: [start, end).
type dataRun struct{ start, end int64 }

// chunkRuns is the index entry of one chunk.
type chunkRuns struct {
	runs []dataRun
	ref  atomic.Bool // CLOCK reference bit
	idx  int64
}

func (e *chunkRuns) refBit() *atomic.Bool { return &e.ref }
func (e *chunkRuns) pinned() bool         { return false }
func (e *chunkRuns) bytes() int64         { return int64(len(e.runs)+1) * 16 }

// holeIndex caches the data runs of chunks. mu guards chunks and ring;
// entries are immutable once published. Building a chunk happens outside
// the lock; two requests may build the same chunk at once, and the second
// result is dropped.
type holeIndex struct {
	chunkBits uint

	mu     sync.Mutex
	chunks map[int64]*chunkRuns
	ring   clockRing[*chunkRuns]
}

func (img *Image) index() *holeIndex {
	img.indexOnce.Do(func() {
		l := img.top
		bits := uint(chunkMinBits)
		if !l.raw {
			if b := l.clusterBits + l.l2Bits; b > bits {
				bits = b
			}
		}
		img.idx = &holeIndex{chunkBits: bits, chunks: map[int64]*chunkRuns{}}
		img.idx.ring.capacity = indexBudget
	})
	return img.idx
}

// chunk returns the data runs of chunk c, building the entry if needed.
func (img *Image) chunk(c int64) ([]dataRun, error) {
	x := img.index()
	x.mu.Lock()
	if e := x.chunks[c]; e != nil {
		x.mu.Unlock()
		e.ref.Store(true)
		return e.runs, nil
	}
	x.mu.Unlock()

	runs, err := img.buildChunk(c<<x.chunkBits, (c+1)<<x.chunkBits)
	if err != nil {
		return nil, err
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if e := x.chunks[c]; e != nil {
		return e.runs, nil
	}
	e := &chunkRuns{runs: runs, idx: c}
	x.ring.add(e, func(old *chunkRuns) { delete(x.chunks, old.idx) })
	x.chunks[c] = e
	return runs, nil
}

// buildChunk walks the extents of [start, end) (clipped to the disk) and
// returns its data runs, adjacent runs merged.
func (img *Image) buildChunk(start, end int64) ([]dataRun, error) {
	end = min(end, img.top.vsize())
	var runs []dataRun
	for off := start; off < end; {
		e, err := img.top.extent(off, end-off, probeAll)
		if err != nil {
			return nil, err
		}
		if e.Status&StatusZero == 0 {
			if n := len(runs); n > 0 && runs[n-1].end == off {
				runs[n-1].end = off + e.Length
			} else {
				runs = append(runs, dataRun{off, off + e.Length})
			}
		}
		off += e.Length
	}
	return runs, nil
}

// NextData returns the first offset at or after off that holds data, like
// lseek(SEEK_DATA); ErrNoData if there is none (or off is at or past the
// end of the disk).
func (img *Image) NextData(off int64) (int64, error) {
	size := img.top.vsize()
	if off < 0 {
		off = 0
	}
	bits := img.index().chunkBits
	for off < size {
		c := off >> bits
		runs, err := img.chunk(c)
		if err != nil {
			return 0, err
		}
		i := sort.Search(len(runs), func(i int) bool { return runs[i].end > off })
		if i < len(runs) {
			return max(runs[i].start, off), nil
		}
		off = (c + 1) << bits
	}
	return 0, ErrNoData
}

// NextHole returns the first offset at or after off that lies in a hole,
// like lseek(SEEK_HOLE): the end of the disk counts as a hole. off must be
// inside the disk.
func (img *Image) NextHole(off int64) (int64, error) {
	size := img.top.vsize()
	if off < 0 {
		off = 0
	}
	bits := img.index().chunkBits
	for off < size {
		c := off >> bits
		runs, err := img.chunk(c)
		if err != nil {
			return 0, err
		}
		i := sort.Search(len(runs), func(i int) bool { return runs[i].end > off })
		if i == len(runs) || runs[i].start > off {
			return off, nil
		}
		// off is in a data run; a run ending at the chunk's end may go
		// on in the next chunk.
		off = runs[i].end
		if off < (c+1)<<bits {
			return min(off, size), nil
		}
	}
	return size, nil
}

// DataBytes returns how many bytes of the disk hold data (the complement
// of the holes NextHole reports). It walks the whole index, so it reads
// every allocated L2 table of the chain once.
func (img *Image) DataBytes() (int64, error) { return img.DataBytesIn(0, img.top.vsize()) }

// DataBytesIn is DataBytes for the guest range [start, end).
func (img *Image) DataBytesIn(start, end int64) (int64, error) {
	var total int64
	bits := img.index().chunkBits
	end = min(end, img.top.vsize())
	for c := max(start, 0) >> bits; c<<bits < end; c++ {
		runs, err := img.chunk(c)
		if err != nil {
			return 0, err
		}
		for _, r := range runs {
			if a, b := max(r.start, start), min(r.end, end); a < b {
				total += b - a
			}
		}
	}
	return total, nil
}
