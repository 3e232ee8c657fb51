package qcow2

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
)

// The allocator without an image file: a fake of what it is handed
// (allocEnv), and the specification's rules as the oracle, read back with
// a decoder of the test's own ("Host cluster management": a refcount
// block is one cluster of refcount_bits-wide entries, cluster_size * 8 /
// refcount_bits of them; entries of 8 bits or more are big-endian,
// narrower ones packed from bit 0 of each byte, as qemu's
// get_refcount_ro0..6 read them).

// fakeAllocEnv holds refcount blocks in memory by offset, records what
// the allocator adds to the metadata map and how far it reserves the
// file, and refuses to grow the refcount table (the tests give it room).
type fakeAllocEnv struct {
	cs       int64
	blocks   map[int64]*table   // refcount blocks by host offset
	whole    map[int64]bool     // made new, to be written whole
	meta     map[int64]MetaKind // metadata by cluster index, as addMeta recorded it
	dirty    map[int64]bool     // blocks handed out for changing
	reserved int64              // the file's size as reserveFile left it
	grows    []int64            // growReftable calls
}

func newFakeAllocEnv(cs int64) *fakeAllocEnv {
	return &fakeAllocEnv{cs: cs, blocks: map[int64]*table{}, whole: map[int64]bool{}, meta: map[int64]MetaKind{}, dirty: map[int64]bool{}}
}

func (f *fakeAllocEnv) refblock(off int64) (*table, error) {
	t, ok := f.blocks[off]
	if !ok {
		return nil, fmt.Errorf("no refcount block at %#x", off)
	}
	return t, nil
}

func (f *fakeAllocEnv) dirtyRefblock(off int64) (*table, error) {
	f.dirty[off] = true
	return f.refblock(off)
}

func (f *fakeAllocEnv) newRefblock(off int64, whole bool) *table {
	t := &table{words: make([]uint64, f.cs/8)}
	f.blocks[off], f.whole[off], f.dirty[off] = t, whole, true
	return t
}

func (f *fakeAllocEnv) addMeta(off, n int64, k MetaKind) error {
	for c := off / f.cs; c < (off+n)/f.cs; c++ {
		if old, ok := f.meta[c]; ok {
			return fmt.Errorf("a new %v at cluster %d overlaps the %v there", k, c, old)
		}
		f.meta[c] = k
	}
	return nil
}

func (f *fakeAllocEnv) checkClusters(what string, off, n int64, allowed MetaKinds) error {
	for c := off / f.cs; c < (off+n)/f.cs; c++ {
		if k, ok := f.meta[c]; ok && !allowed.Has(k) {
			return fmt.Errorf("%s cluster %d: holds a %v", what, c, k)
		}
	}
	return nil
}

func (f *fakeAllocEnv) reserveFile(size int64) error {
	f.reserved = max(f.reserved, size)
	return nil
}

func (f *fakeAllocEnv) growReftable(need int64) error {
	f.grows = append(f.grows, need)
	return errors.New("the test's refcount table has room enough")
}

// refBits is the test's reading of a refcount block's bytes.
type refBits struct {
	bits     int
	perBlock int64
}

func (r refBits) get(block []byte, i int64) uint64 {
	switch r.bits {
	case 1, 2, 4:
		b := block[i*int64(r.bits)/8]
		return uint64(b>>(uint(i*int64(r.bits))%8)) & (1<<r.bits - 1)
	case 8:
		return uint64(block[i])
	case 16:
		return uint64(binary.BigEndian.Uint16(block[2*i:]))
	case 32:
		return uint64(binary.BigEndian.Uint32(block[4*i:]))
	default:
		return binary.BigEndian.Uint64(block[8*i:])
	}
}

func (r refBits) set(block []byte, i int64, v uint64) {
	switch r.bits {
	case 1, 2, 4:
		shift := uint(i*int64(r.bits)) % 8
		p := &block[i*int64(r.bits)/8]
		*p = *p&^byte((1<<r.bits-1)<<shift) | byte(v<<shift)
	case 16:
		binary.BigEndian.PutUint16(block[2*i:], uint16(v))
	default:
		binary.BigEndian.PutUint64(block[8*i:], v)
	}
}

// bytesOf and tableOf convert between a block's words (as the cache
// holds them: the on-disk big-endian words) and its bytes.
func bytesOf(t *table) []byte {
	b := make([]byte, len(t.words)*8)
	for i := range t.words {
		binary.BigEndian.PutUint64(b[8*i:], t.word(int64(i)))
	}
	return b
}

func tableOf(b []byte) *table {
	t := &table{words: make([]uint64, len(b)/8)}
	for i := range t.words {
		t.words[i] = binary.BigEndian.Uint64(b[8*i:])
	}
	return t
}

// TestAllocatorWithoutImage: allocations, reuse, new refcount blocks and
// a table on an allocator over the fake, for 1-, 16- and 64-bit
// refcounts with 512-byte clusters. The image starts with its header
// (cluster 0), refcount table (1), one refcount block (2) and L1 table
// (3), as qemu-img create lays them out.
func TestAllocatorWithoutImage(t *testing.T) {
	const cs = 512
	for _, order := range []uint32{0, 4, 6} {
		r := refBits{bits: 1 << order}
		r.perBlock = cs * 8 / int64(r.bits) // the specification's refcount_block_entries
		P := r.perBlock
		t.Run(fmt.Sprintf("%d-bit", r.bits), func(t *testing.T) {
			env := newFakeAllocEnv(cs)
			block0 := make([]byte, cs)
			for c := range int64(4) {
				r.set(block0, c, 1)
			}
			env.blocks[2*cs] = tableOf(block0)
			env.meta[0], env.meta[1], env.meta[2], env.meta[3] = MetaHeader, MetaRefcountTable, MetaRefcountBlock, MetaL1
			env.reserved = 4 * cs
			reft := make([]uint64, cs/8)
			reft[0] = 2 * cs
			var count atomic.Int64
			a, err := newAllocator(env, "fake", cs, order, reft, cs, &count)
			if err != nil {
				t.Fatal(err)
			}

			// refcount reads cluster c's refcount the test's way: the
			// refcount table entry, the block's bytes, the entry.
			refcount := func(c int64) uint64 {
				off := int64(a.reft.words[c/P] & reftOffsetMask)
				if off == 0 {
					return 0
				}
				blk, ok := env.blocks[off]
				if !ok {
					t.Fatalf("the refcount table names a block at %#x that was never made", off)
				}
				return r.get(bytesOf(blk), c%P)
			}
			// counted are the clusters the test expects a refcount of 1;
			// every other cluster must read 0.
			counted := map[int64]bool{0: true, 1: true, 2: true, 3: true}
			check := func(step string) {
				t.Helper()
				top := int64(0)
				for c := range counted {
					top = max(top, c+1)
				}
				for c := range top + P {
					want := uint64(0)
					if counted[c] {
						want = 1
					}
					if got := refcount(c); got != want {
						t.Fatalf("%s: cluster %d has refcount %d, want %d", step, c, got, want)
					}
				}
				for ti, e := range a.reft.words {
					off := int64(e & reftOffsetMask)
					if off == 0 {
						continue
					}
					// A refcount block is counted (by itself or another
					// block), and is in the metadata map as one.
					if refcount(off/cs) == 0 {
						t.Errorf("%s: refcount block %d at cluster %d counts for nothing", step, ti, off/cs)
					}
					if env.meta[off/cs] != MetaRefcountBlock {
						t.Errorf("%s: refcount block %d at cluster %d is %v in the metadata map", step, ti, off/cs, env.meta[off/cs])
					}
				}
				if env.reserved < top*cs {
					t.Errorf("%s: the file reaches %d bytes; cluster %d is counted", step, env.reserved, top-1)
				}
			}
			// alloc allocates n clusters and expects them as runs of
			// [first, end) cluster indices; they were free before.
			alloc := func(n int64, want ...[2]int64) {
				t.Helper()
				for _, w := range want {
					for c := w[0]; c < w[1]; c++ {
						if counted[c] {
							t.Fatalf("allocating %d: cluster %d is expected again, but is in use", n, c)
						}
						counted[c] = true
					}
				}
				runs, err := a.allocate(n)
				if err != nil {
					t.Fatalf("allocating %d: %v", n, err)
				}
				var got [][2]int64
				for _, h := range runs {
					got = append(got, [2]int64{h.start / cs, h.end / cs})
				}
				if fmt.Sprint(got) != fmt.Sprint(want) {
					t.Fatalf("allocating %d: clusters %v, want %v", n, got, want)
				}
				check(fmt.Sprintf("after allocating %d", n))
			}
			check("at open")

			// First fit past what is in use, then a freed cluster is
			// the first reused.
			alloc(3, [2]int64{4, 7})
			if err := a.setRefcount(5, 0); err != nil {
				t.Fatal(err)
			}
			a.released(5)
			delete(counted, 5)
			check("after freeing cluster 5")
			alloc(1, [2]int64{5, 6})
			alloc(2, [2]int64{7, 9})
			// Two free clusters between used ones: a run of three
			// takes them, then continues past the end.
			for _, c := range []int64{6, 7} {
				if err := a.setRefcount(c, 0); err != nil {
					t.Fatal(err)
				}
				a.released(c)
				delete(counted, c)
			}
			alloc(3, [2]int64{6, 8}, [2]int64{9, 10})

			// Up to the end of block 0's range, then into block 1's,
			// which does not exist: it goes into the first cluster it
			// describes, P, and counts itself; the allocation follows.
			alloc(P-10, [2]int64{10, P})
			counted[P] = true // the new block
			alloc(2, [2]int64{P + 1, P + 3})
			if off := int64(a.reft.words[1] & reftOffsetMask); off != P*cs {
				t.Fatalf("refcount block 1 at %#x, want the first cluster of its range, %#x", off, P*cs)
			}
			if got := r.get(bytesOf(env.blocks[P*cs]), 0); got != 1 {
				t.Errorf("refcount block 1 gives itself refcount %d, want 1 (it describes itself)", got)
			}

			// A table of P clusters from P+3 crosses into block 2's
			// range: block 2 goes right before the table (into block
			// 1's range, which counts it), the table after it,
			// contiguous, every cluster counted where its block says.
			off, err := a.allocateTable(P)
			if err != nil {
				t.Fatal(err)
			}
			if off != (P+4)*cs {
				t.Fatalf("a table of %d clusters at cluster %d, want %d (after its refcount block at %d)", P, off/cs, P+4, P+3)
			}
			if b2 := int64(a.reft.words[2] & reftOffsetMask); b2 != (P+3)*cs {
				t.Fatalf("refcount block 2 at cluster %d, want %d, right before the table", b2/cs, P+3)
			}
			if !env.whole[(P+3)*cs] {
				t.Errorf("refcount block 2, made for a table, is not written whole")
			}
			for c := P + 3; c < 2*P+4; c++ {
				counted[c] = true
			}
			check("after allocating a table")
			if len(env.grows) != 0 {
				t.Errorf("the refcount table was asked to grow to %v entries; it has %d", env.grows, len(a.reft.words))
			}
			if got := count.Load(); got != 3+1+2+3+(P-10)+2 {
				t.Errorf("%d clusters counted as allocated, want %d (a table's are not)", got, 3+1+2+3+(P-10)+2)
			}
		})
	}
}
