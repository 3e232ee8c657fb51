package qcow2

import (
	"sync/atomic"
)

// The chain index: which layer of a backing chain decides each piece of
// the disk, so that a read that falls through the top image asks one
// layer below it, not every one on the way down.
//
// Resolving a guest range walks the chain from the top until a layer
// allocates it (data, compressed or zeros) or has no backing file for it
// (zeros): one L2 lookup per layer passed. In a deep chain whose layers
// each hold a little of the disk (a layer per build step or snapshot) a
// read passes half the chain on average.
//
// Only the top image is ever written: a backing file is read-only for as
// long as it is open (qcowfs shows an image that is another's backing file
// read-only). So what the layers below the top say of a guest range never
// changes, and the index can remember it for good: per granule (the
// smallest cluster or subcluster of those layers, the finest grain at
// which their answers can change), the depth of the layer that decides it.
// The top is always asked first, so its writes, discards and overlays need
// nothing from the index. A lookup that finds a depth asks that layer
// directly; the layers above it are unallocated there, which is exactly
// what skipping them assumes. A granule whose parts are decided by
// different layers (a backing file that ends inside it) is marked mixed
// and always walked. A granule not seen yet is resolved with the 63 around
// it, a layer at a time (resolve).
//
// The depths live in chunks of 4096 granules (4 KiB), kept in the shared
// table Cache under an owner of the index's own, so they count against
// the mount's L2 cache budget and are evicted like tables (a chunk
// evicted is rebuilt as reads come). Per GiB of virtual disk that is
// 16 KiB at 64 KiB clusters, 256 KiB at 4 KiB and 2 MiB at 512 B,
// whatever the number of layers.

// chainIndex is the index of the layers from depth base down.
type chainIndex struct {
	cache  *Cache
	owner  uint64
	gBits  uint     // log2 of the granule
	layers []*layer // layers[i] is at depth base+i
	base   int
}

const (
	indexUnknown   = 0    // not resolved yet
	indexMixed     = 0xff // decided by more than one layer: walk
	indexChunkBits = 12   // granules per chunk
)

// indexMinLayers is the fewest qcow2 layers below the top for which an
// index pays. An indexed read costs the top's lookup, the chunk's and the
// deciding layer's; walking costs a lookup per layer passed, half the
// chain on average (BenchmarkChainRead, CPU per 4 KiB read: a chain of 4
// 2.48 µs indexed against 2.15 walked, of 16 2.85 against 3.2, of 64 2.58
// against 8.5; 2.0 for one image).
const indexMinLayers = 8

// newChainIndex returns an index of the chain from l down, or nil where
// it would not pay or cannot be kept (too few layers, too deep for a
// byte of depth, no cache).
func newChainIndex(l *layer, cache *Cache) *chainIndex {
	x := &chainIndex{cache: cache, base: l.depth, gBits: 63}
	qcow := 0
	for b := l; b != nil; b = b.backing {
		x.layers = append(x.layers, b)
		if !b.raw {
			qcow++
			x.gBits = min(x.gBits, b.scBits)
		}
	}
	if cache == nil || qcow < indexMinLayers || l.depth+len(x.layers) >= indexMixed {
		return nil
	}
	x.gBits = max(x.gBits, 9)
	x.owner = cache.newOwner()
	return x
}

// close drops the index's chunks from the cache.
func (x *chainIndex) close() { x.cache.drop(x.owner) }

// chunk returns the chunk holding granule g.
func (x *chainIndex) chunk(g int64) (*table, error) {
	return x.cache.get(cacheKey{owner: x.owner, off: g >> indexChunkBits}, func() ([]uint64, error) {
		return make([]uint64, 1<<indexChunkBits/8), nil
	})
}

// depthOf returns granule g's entry in chunk t.
func depthOf(t *table, g int64) uint8 {
	i := g & (1<<indexChunkBits - 1)
	return uint8(t.word(i/8) >> (8 * (i % 8)))
}

// record sets granule g's entry in chunk t to d, if it is unknown
// (concurrent recorders agree: the answer never changes).
func record(t *table, g int64, d uint8) {
	i := g & (1<<indexChunkBits - 1)
	w := &t.words[i/8]
	shift := 8 * (i % 8)
	for {
		old := atomic.LoadUint64(w)
		if uint8(old>>shift) != indexUnknown || atomic.CompareAndSwapUint64(w, old, old|uint64(d)<<shift) {
			return
		}
	}
}

// extent resolves [off, off+n) from the index's top layer down, as
// layer.extent does (off inside that layer's disk).
func (x *chainIndex) extent(off, n int64, p probe) (Extent, error) {
	top := x.layers[0]
	g := off >> x.gBits
	t, err := x.chunk(g)
	if err != nil {
		return top.extent(off, n, p)
	}
	d := depthOf(t, g)
	if d == indexUnknown {
		if err := x.resolve(t, g); err != nil {
			return Extent{}, err
		}
		d = depthOf(t, g)
	}
	if d == indexMixed || d == indexUnknown {
		return top.extent(off, n, p)
	}
	// The run of granules decided by the same layer, within the chunk.
	end := (g + 1) << x.gBits
	for h := g + 1; end < off+n && h>>indexChunkBits == g>>indexChunkBits && depthOf(t, h) == d; h++ {
		end = (h + 1) << x.gBits
	}
	l := x.layers[int(d)-x.base]
	if off >= l.vsize() {
		return top.extent(off, n, p) // (never: the layer above decides there)
	}
	return l.extent(off, min(n, end-off), p)
}

// resolveBits is log2 of the granules resolved together on a miss.
const resolveBits = 6

// resolve records the deciding layer of every granule of the aligned
// block of 1<<resolveBits granules around g, in chunk t. It goes down the
// chain a layer at a time, asking each layer only for what the layers
// above left unallocated, in runs (layer.lookup): a layer above the one
// that decides costs one lookup per run it leaves, not one per granule, so
// a block costs about what walking the chain for one granule did.
func (x *chainIndex) resolve(t *table, g int64) error {
	const n = 1 << resolveBits
	first := g &^ (n - 1)
	start := first << x.gBits
	end := min(start+n<<x.gBits, x.layers[0].vsize())
	var dec [n]int     // the deciding depth of each granule; 0: none yet
	var cover [n]int64 // and how many of its bytes it decided
	mark := func(a, b int64, d int) {
		for h := a >> x.gBits; h<<x.gBits < b; h++ {
			i := h - first
			lo, hi := max(a, h<<x.gBits), min(b, (h+1)<<x.gBits)
			switch {
			case dec[i] == 0:
				dec[i] = d
			case dec[i] != d:
				dec[i] = indexMixed
			}
			cover[i] += hi - lo
		}
	}
	pending := []hostRange{{start, end}} // guest ranges no layer decided yet
	for _, l := range x.layers {
		var next []hostRange
		for _, r := range pending {
			// Past the end of this layer, the layer above decides:
			// zeros (layer.extent's rule).
			if r.end > l.vsize() {
				mark(max(r.start, l.vsize()), r.end, l.depth-1)
				r.end = max(r.start, l.vsize())
			}
			for pos := r.start; pos < r.end; {
				if l.raw {
					mark(pos, r.end, l.depth)
					break
				}
				run, err := l.lookup(pos, r.end-pos)
				if err != nil {
					return err
				}
				if run.length <= 0 {
					mark(pos, r.end, indexMixed)
					break
				}
				if run.kind == kindUnallocated && l.backing != nil {
					next = append(next, hostRange{pos, pos + run.length})
				} else {
					mark(pos, pos+run.length, l.depth)
				}
				pos += run.length
			}
		}
		pending = next
	}
	for i := range int64(n) {
		d := dec[i]
		if d == 0 || cover[i] != 1<<x.gBits {
			d = indexMixed // the end of the disk, or not decided whole
		}
		record(t, first+i, uint8(d))
	}
	return nil
}
