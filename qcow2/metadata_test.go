package qcow2

import (
	"math/rand/v2"
	"path/filepath"
	"slices"
	"testing"

	"github.com/qcowfs/qcowfs/test/qemu"
)

func TestMetadataOverlap(t *testing.T) {
	b := metaBuilder{clusterBits: 12}
	b.add(0, 4096, MetaHeader)
	b.add(8192, 4096, MetaL2)
	b.add(12288, 4096, MetaL2) // merges with the one before
	b.add(20480, 8192, MetaRefcountBlock)
	b.add(24576, 8192, MetaL1)         // shares a cluster with the block: both kinds there
	b.add(40960+100, 8, MetaL1)        // 8 bytes claim the whole cluster
	b.add(45056, 4096, MetaSnapshotL2) // and a table exactly over another
	b.add(45056, 4096, MetaL2)
	m := b.build()
	want := []MetaRange{
		{0, 4096, Kinds(MetaHeader)},
		{8192, 16384, Kinds(MetaL2)},
		{20480, 24576, Kinds(MetaRefcountBlock)},
		{24576, 28672, Kinds(MetaRefcountBlock, MetaL1)},
		{28672, 32768, Kinds(MetaL1)},
		{40960, 45056, Kinds(MetaL1)},
		{45056, 49152, Kinds(MetaL2, MetaSnapshotL2)},
	}
	if got := m.Ranges(); !slices.Equal(got, want) {
		t.Fatalf("ranges %v, want %v", got, want)
	}
	for _, tc := range []struct {
		start, end int64
		kinds      MetaKinds // 0: no overlap
	}{
		{0, 1, Kinds(MetaHeader)},
		{4095, 4097, Kinds(MetaHeader)},
		{4096, 8192, 0},
		{8191, 8193, Kinds(MetaL2)},
		{16384, 20480, 0},
		{16384, 20481, Kinds(MetaRefcountBlock)},
		{30000, 30001, Kinds(MetaL1)},
		{40960, 40961, Kinds(MetaL1)}, // before the L1's 8 bytes, in its cluster
		{32768, 40960, 0},
		{49152, 1 << 40, 0},
	} {
		r, ok := m.Overlap(tc.start, tc.end)
		if ok != (tc.kinds != 0) || (ok && r.Kinds != tc.kinds) {
			t.Errorf("Overlap(%d, %d) = %v, %v; want %v", tc.start, tc.end, r, ok, tc.kinds)
		}
	}
	// What may be written where: an L2 table only where L2 tables are,
	// guest data nowhere.
	for _, tc := range []struct {
		start, end int64
		allowed    MetaKinds
		bad        bool
	}{
		{8192, 16384, Kinds(MetaL2), false},
		{8192, 16384, 0, true},
		{24576, 28672, Kinds(MetaRefcountBlock), true}, // the L1 table shares it
		{20480, 24576, Kinds(MetaRefcountBlock), false},
		{45056, 49152, Kinds(MetaL2), true}, // a snapshot's table too
		{45056, 49152, Kinds(MetaL2, MetaSnapshotL2), false},
		{32768, 40960, 0, false},
	} {
		if _, bad := m.conflict(tc.start, tc.end, tc.allowed); bad != tc.bad {
			t.Errorf("conflict(%d, %d, %v) = %v", tc.start, tc.end, tc.allowed, bad)
		}
	}
}

// TestMetadataOfImage: every table the header and L1 name is in the map,
// and no data cluster qemu-img map reports overlaps it.
func TestMetadataOfImage(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "m.qcow2")
	qemu.Create(t, "qcow2", p, "64M", "-o", "cluster_size=4096")
	qemu.IO(t, p, "write -P 1 0 1M", "write -P 2 40M 1M")
	qemu.Img(t, "snapshot", "-c", "s1", p)
	qemu.IO(t, p, "write -P 3 512k 1M")
	img, err := Open(p, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	m, err := img.Metadata()
	if err != nil {
		t.Fatal(err)
	}
	h := img.Header()
	for _, want := range []struct {
		off  int64
		kind MetaKind
	}{{0, MetaHeader}, {int64(h.L1TableOffset), MetaL1}, {int64(h.RefcountTableOffset), MetaRefcountTable}, {int64(h.SnapshotsOffset), MetaSnapshotTable}} {
		if r, ok := m.Overlap(want.off, want.off+1); !ok || r.Kinds != Kinds(want.kind) {
			t.Errorf("offset %#x: %v, %v; want %v", want.off, r, ok, want.kind)
		}
	}
	for _, e := range qemu.Map(t, p) {
		if e.Data && e.Offset != nil {
			if r, ok := m.Overlap(*e.Offset, *e.Offset+e.Length); ok {
				t.Errorf("data %+v overlaps %v", e, r)
			}
		}
	}
}

// BenchmarkMetadataOverlap queries a map of 100k metadata ranges.
func BenchmarkMetadataOverlap(b *testing.B) {
	mb := metaBuilder{clusterBits: 16}
	r := rand.New(rand.NewPCG(1, 1))
	for i := int64(0); i < 100000; i++ {
		mb.add(i*3*65536, 65536, MetaKind(1+r.IntN(10)))
	}
	m := mb.build()
	if len(m.Ranges()) != 100000 {
		b.Fatalf("%d ranges", len(m.Ranges()))
	}
	offs := make([]int64, 4096)
	for i := range offs {
		offs[i] = r.Int64N(100000 * 3 * 65536)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		o := offs[i%len(offs)]
		m.Overlap(o, o+65536)
	}
}

// TestMetadataWith checks the map's updates against a model: an array of
// kind sets, one per cluster, after random additions and removals of
// kinds over byte ranges (which claim the clusters they touch).
func TestMetadataWith(t *testing.T) {
	const clusters, cs = 64, 512
	r := rand.New(rand.NewPCG(1, 2))
	for round := 0; round < 200; round++ {
		model := make([]MetaKinds, clusters)
		m := &MetadataMap{clusterBits: 9}
		for op := 0; op < 40; op++ {
			start := int64(r.IntN(clusters*cs - 1))
			end := start + 1 + int64(r.IntN(min(clusters*cs-int(start), 3*cs)))
			kind := MetaKind(1 + r.IntN(3))
			add := r.IntN(3) > 0
			if add {
				m = m.with(start, end, kind)
			} else {
				m = m.without(start, end, kind)
			}
			for c := start / cs; c <= (end-1)/cs; c++ {
				if add {
					model[c] |= Kinds(kind)
				} else {
					model[c] &^= Kinds(kind)
				}
			}
			// The map must be sorted, disjoint, of whole clusters,
			// without empty or mergeable neighbours, and say what the
			// model says.
			got := make([]MetaKinds, clusters)
			for k, x := range m.ranges {
				if x.Start >= x.End || x.Kinds == 0 || x.Start%cs != 0 || x.End%cs != 0 {
					t.Fatalf("round %d: bad range %+v", round, x)
				}
				if k > 0 {
					p := m.ranges[k-1]
					if p.End > x.Start || (p.End == x.Start && p.Kinds == x.Kinds) {
						t.Fatalf("round %d: ranges %+v and %+v overlap or should merge", round, p, x)
					}
				}
				for c := x.Start / cs; c < x.End/cs; c++ {
					got[c] = x.Kinds
				}
			}
			if !slices.Equal(got, model) {
				t.Fatalf("round %d op %d: map %v, model %v", round, op, got, model)
			}
		}
	}
}

// TestMetadataMerge checks building against the same model: overlapping
// ranges of several kinds, in any order, merged in place or swept.
func TestMetadataMerge(t *testing.T) {
	const clusters, cs = 64, 512
	r := rand.New(rand.NewPCG(3, 4))
	for round := 0; round < 500; round++ {
		model := make([]MetaKinds, clusters)
		b := metaBuilder{clusterBits: 9}
		for range 1 + r.IntN(20) {
			start := int64(r.IntN(clusters*cs - 1))
			n := 1 + int64(r.IntN(min(clusters*cs-int(start), 4*cs)))
			kind := MetaKind(1 + r.IntN(4))
			b.add(start, n, kind)
			for c := start / cs; c <= (start+n-1)/cs; c++ {
				model[c] |= Kinds(kind)
			}
		}
		m := b.build()
		want := &MetadataMap{clusterBits: 9}
		for c, k := range model {
			for kind := MetaHeader; kind <= MetaBitmapData; kind++ {
				if k.Has(kind) {
					want = want.with(int64(c)*cs, int64(c+1)*cs, kind)
				}
			}
		}
		if !slices.Equal(m.ranges, want.ranges) {
			t.Fatalf("round %d: built %v, want %v", round, m.ranges, want.ranges)
		}
	}
}
