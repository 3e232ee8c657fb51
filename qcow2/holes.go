package qcow2

import (
	"context"
	"errors"
	"fmt"
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
//
// The walks are bounded, whatever the image says:
//
//   - Cheap where the tables say nothing: the walk goes straight to the
//     next L1 entry that names an L2 table (in any layer of the chain), so
//     a disk of 2^62 bytes with a small L1 table costs its L1 table.
//   - Cheap when tables repeat: in an image without a backing file, the
//     data runs of an L2 table depend on the table alone, so they are kept
//     per table (a budget of its own) and an L2 table that many L1 entries
//     name is walked once.
//   - Bounded per call: each call has a budget of work (extents looked up,
//     chunks and tables visited); when it runs out the answer is
//     conservative (NextData: data at the place reached; NextHole: no hole
//     before the end of the disk; never a hole where there might be data),
//     and the image's Warnf gets one line. DataBytesIn fails instead.
//   - Interruptible: NextData, NextHole and DataBytesIn stop when their
//     context is done.

const (
	chunkMinBits = 26 // 64 MiB
	// indexBudget bounds the memory of one image's index: 1 MiB, 64Ki
	// runs of 16 bytes; the per-table runs have a budget as large.
	indexBudget = 1 << 20
	// SeekWork is the work one NextData or NextHole call may do: about
	// a million extent lookups, a fraction of a second.
	SeekWork = 1 << 20
	// CountWork is the work one DataBytes call may do.
	CountWork = 64 << 20
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

// tableRuns is the data runs of one L2 table of the top layer, relative
// to the start of the guest range it maps; kept only for images without a
// backing file, where they depend on nothing else.
type tableRuns struct {
	runs []dataRun
	ref  atomic.Bool
	off  int64 // the table's host offset
}

func (e *tableRuns) refBit() *atomic.Bool { return &e.ref }
func (e *tableRuns) pinned() bool         { return false }
func (e *tableRuns) bytes() int64         { return int64(len(e.runs)+1) * 16 }

// holeIndex caches the data runs of chunks and of L2 tables. mu guards
// chunks, tables and their rings; entries are immutable once published.
// Building a chunk happens outside the lock; two requests may build the
// same chunk at once, and the second result is dropped.
type holeIndex struct {
	chunkBits uint

	mu     sync.Mutex
	chunks map[int64]*chunkRuns
	ring   clockRing[*chunkRuns]
	tables map[int64]*tableRuns
	tring  clockRing[*tableRuns]

	warned atomic.Bool // a walk ran out of budget; logged once
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
		x := &holeIndex{chunkBits: bits, chunks: map[int64]*chunkRuns{}, tables: map[int64]*tableRuns{}}
		x.ring.capacity = indexBudget
		x.tring.capacity = indexBudget
		img.idx.Store(x)
	})
	return img.idx.Load()
}

// walk is the state of one bounded walk: its context and the work left.
type walk struct {
	ctx  context.Context
	left int64
	n    int
}

func newWalk(ctx context.Context, work int64) *walk { return &walk{ctx: ctx, left: work} }

// spend takes n units of work, failing when the budget is spent or the
// context is done.
func (w *walk) spend(n int64) error {
	w.left -= n
	if w.left < 0 {
		return ErrWalkBudget
	}
	if w.n++; w.n&255 == 0 {
		return w.ctx.Err()
	}
	return nil
}

// unsure notes, once per image, that a walk gave a conservative answer.
func (img *Image) unsure(what string, off int64) {
	if img.index().warned.Swap(true) || img.warnf == nil {
		return
	}
	img.warnf("%s: %s at offset %d gave up after its work budget (the image's tables describe more than a bounded walk can answer); answering conservatively: data where unsure. Further cases are not logged", img.top.name, what, off)
}

// chunk returns the data runs of chunk c, building the entry if needed.
func (img *Image) chunk(c int64, w *walk) ([]dataRun, error) {
	x := img.index()
	if err := w.spend(1); err != nil {
		return nil, err
	}
	x.mu.Lock()
	if e := x.chunks[c]; e != nil {
		x.mu.Unlock()
		e.ref.Store(true)
		return e.runs, nil
	}
	x.mu.Unlock()

	runs, err := img.buildChunk(c<<x.chunkBits, (c+1)<<x.chunkBits, w)
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

// appendRun adds [start, end) to runs, merging it with the last run if
// they touch.
func appendRun(runs []dataRun, start, end int64) []dataRun {
	if n := len(runs); n > 0 && runs[n-1].end == start {
		runs[n-1].end = end
		return runs
	}
	return append(runs, dataRun{start, end})
}

// buildChunk walks the extents of [start, end) (clipped to the disk) and
// returns its data runs, adjacent runs merged. It goes one L2 table's span
// at a time (a chunk holds one or more whole spans): a span whose L1 entry
// is empty in an image without a backing file is a hole at once, and a
// span whose table was walked before reuses that walk.
func (img *Image) buildChunk(start, end int64, w *walk) ([]dataRun, error) {
	l := img.top
	end = min(end, l.vsize())
	if l.raw {
		return l.walkRuns(nil, start, end, w)
	}
	x := img.index()
	span := l.clusterSize() << l.l2Bits
	// (Not for an image the writer changes: its tables change in place,
	// and their runs with them.)
	memo := l.backing == nil && !l.writable
	var runs []dataRun
	for off := start; off < end; {
		pieceEnd := min(end, (off/span+1)*span)
		t := l.l1.Load()
		var l2 int64
		if i := off / span; i < t.len() {
			l2 = t.entry(i).l2Offset()
		}
		if l2 == 0 && memo {
			off = pieceEnd // unallocated, nothing below: a hole
			continue
		}
		if memo {
			x.mu.Lock()
			e := x.tables[l2]
			x.mu.Unlock()
			if e != nil {
				if err := w.spend(1); err != nil {
					return nil, err
				}
				e.ref.Store(true)
				for _, r := range e.runs {
					if s := off + r.start; s < pieceEnd {
						runs = appendRun(runs, s, min(off+r.end, pieceEnd))
					}
				}
				off = pieceEnd
				continue
			}
		}
		// Reading a table may wait (on a remote server): a walk whose
		// caller is gone stops before it.
		if err := w.ctx.Err(); err != nil {
			return nil, err
		}
		n := len(runs)
		var err error
		if runs, err = l.walkRuns(runs, off, pieceEnd, w); err != nil {
			return nil, err
		}
		if memo && pieceEnd-off == span {
			// Remember the table's runs, relative to its span (the
			// first may have merged into the run before it).
			rel := make([]dataRun, 0, len(runs)-n+1)
			for i := max(n-1, 0); i < len(runs); i++ {
				if s, e := max(runs[i].start, off), runs[i].end; s < e && e > off {
					rel = append(rel, dataRun{s - off, e - off})
				}
			}
			x.mu.Lock()
			if x.tables[l2] == nil {
				te := &tableRuns{runs: rel, off: l2}
				x.tring.add(te, func(old *tableRuns) { delete(x.tables, old.off) })
				x.tables[l2] = te
			}
			x.mu.Unlock()
		}
		off = pieceEnd
	}
	return runs, nil
}

// walkRuns appends the data runs of [start, end) to runs, extent by
// extent, one unit of work each.
func (l *layer) walkRuns(runs []dataRun, start, end int64, w *walk) ([]dataRun, error) {
	for off := start; off < end; {
		if err := w.spend(1); err != nil {
			return nil, err
		}
		e, err := l.extent(off, end-off, probeAll)
		if err != nil {
			return nil, err
		}
		if e.Status&StatusZero == 0 {
			runs = appendRun(runs, off, off+e.Length)
		}
		off += e.Length
	}
	return runs, nil
}

// nextMaybeData returns the first offset at or after off (off < l.vsize())
// that some layer of the chain may store data at: where the top layer's
// L1 table next names an L2 table, or the layer below has something
// first. Everything before it is a hole. It scans L1 tables, a unit of
// work per 4096 entries.
func (l *layer) nextMaybeData(off int64, w *walk) (int64, error) {
	if l.raw {
		return off, nil
	}
	span := l.clusterSize() << l.l2Bits
	t := l.l1.Load()
	next := l.vsize()
	first := off / span
	for i := first; i < t.len() && i*span < l.vsize(); i++ {
		if (i-first)&4095 == 4095 {
			if err := w.spend(1); err != nil {
				return 0, err
			}
		}
		if t.entry(i).l2Offset() != 0 {
			next = max(off, i*span)
			break
		}
	}
	if b := l.backing; b != nil && off < b.vsize() {
		d, err := b.nextMaybeData(off, w)
		if err != nil {
			return 0, err
		}
		next = min(next, d)
	}
	return next, nil
}

// NextData returns the first offset at or after off that holds data,
// like lseek(SEEK_DATA); ErrNoData if there is none (or off is at or
// past the end of the disk). It stops with ctx's error when ctx is done. A
// walk that runs out of its work budget (SeekWork) answers where it got
// to: data there, which is never wrong for a reader.
func (img *Image) NextData(ctx context.Context, off int64) (int64, error) {
	d, err := img.seek(ctx, off, false)
	if err == nil && d >= img.top.vsize() {
		return 0, ErrNoData
	}
	return d, err
}

// NextHole returns the first offset at or after off that lies in a hole,
// like lseek(SEEK_HOLE): the end of the disk counts as a hole. off
// must be inside the disk. It stops with ctx's error when ctx is done. A
// walk that runs out of its work budget (SeekWork) answers the end of the
// disk: no hole before it, which is never wrong for a reader.
func (img *Image) NextHole(ctx context.Context, off int64) (int64, error) {
	return img.seek(ctx, off, true)
}

// seek is lseek's walk over the hole index, chunk by chunk: the first
// offset at or after off that holds data (hole false) or lies in a hole,
// the size of the disk if there is none. Looking for data, it jumps over
// the L1 ranges where no layer has a table.
func (img *Image) seek(ctx context.Context, off int64, hole bool) (int64, error) {
	size := img.top.vsize()
	off = max(off, 0)
	bits := img.index().chunkBits
	w := newWalk(ctx, SeekWork)
	for off < size {
		var runs []dataRun
		d, err := off, error(nil)
		if !hole {
			d, err = img.top.nextMaybeData(off, w)
			if err == nil && d >= size {
				break
			}
		}
		if err == nil {
			off = d
			runs, err = img.chunk(off>>bits, w)
		}
		if errors.Is(err, ErrWalkBudget) {
			if hole {
				img.unsure("SEEK_HOLE", off)
				return size, nil
			}
			img.unsure("SEEK_DATA", off)
			return off, nil
		}
		if err != nil {
			return 0, err
		}
		c := off >> bits
		i := sort.Search(len(runs), func(i int) bool { return runs[i].end > off })
		switch {
		case !hole && i < len(runs):
			return max(runs[i].start, off), nil
		case !hole:
			off = (c + 1) << bits
		case i == len(runs) || runs[i].start > off:
			return off, nil
		default:
			// off is in a data run; a run ending at the chunk's end
			// may go on in the next chunk.
			off = runs[i].end
			if off < (c+1)<<bits {
				return min(off, size), nil
			}
		}
	}
	return size, nil
}

// DataBytes returns how many bytes of the disk hold data (the complement
// of the holes NextHole reports). It walks the whole index, so it
// reads every allocated L2 table of the chain once.
func (img *Image) DataBytes() (int64, error) {
	return img.DataBytesIn(context.Background(), 0, img.top.vsize())
}

// DataBytesIn is DataBytes for the guest range [start, end), stopping with ctx's error when ctx is done, and failing (ErrWalkBudget)
// when the count needs more work than CountWork.
func (img *Image) DataBytesIn(ctx context.Context, start, end int64) (int64, error) {
	return img.dataBytes(ctx, start, end, CountWork)
}

// dataBytes counts the data of [start, end) with work units of work.
func (img *Image) dataBytes(ctx context.Context, start, end, work int64) (int64, error) {
	var total int64
	bits := img.index().chunkBits
	end = min(end, img.top.vsize())
	w := newWalk(ctx, work)
	for off := max(start, 0); off < end; {
		d, err := img.top.nextMaybeData(off, w)
		if err != nil {
			return 0, fmt.Errorf("%s: counting data: %w", img.top.name, err)
		}
		if d >= end {
			break
		}
		c := d >> bits
		runs, err := img.chunk(c, w)
		if err != nil {
			return 0, fmt.Errorf("%s: counting data: %w", img.top.name, err)
		}
		for _, r := range runs {
			if a, b := max(r.start, start), min(r.end, end); a < b {
				total += b - a
			}
		}
		off = (c + 1) << bits
	}
	return total, nil
}
