package qcow2

import (
	"math/rand/v2"
	"path/filepath"
	"testing"

	"github.com/qcowfs/qcowfs/test/qemu"
)

func TestMetadataOverlap(t *testing.T) {
	var b metaBuilder
	b.add(0, 4096, MetaHeader)
	b.add(8192, 4096, MetaL2)
	b.add(12288, 4096, MetaL2) // merges with the one before
	b.add(20480, 8192, MetaRefcountBlock)
	b.add(24576, 8192, MetaL1) // overlaps another kind: keeps what lies beyond
	m := b.build()
	if n := len(m.Ranges()); n != 4 {
		t.Fatalf("%d ranges after merging: %v", n, m.Ranges())
	}
	for _, tc := range []struct {
		start, end int64
		kind       MetaKind // 0: no overlap
	}{
		{0, 1, MetaHeader},
		{4095, 4097, MetaHeader},
		{4096, 8192, 0},
		{8191, 8192, 0},
		{8191, 8193, MetaL2},
		{16383, 16384, MetaL2},
		{16384, 20480, 0},
		{16384, 20481, MetaRefcountBlock},
		{30000, 30001, MetaL1},
		{32768, 1 << 40, 0},
	} {
		r, ok := m.Overlap(tc.start, tc.end)
		if ok != (tc.kind != 0) || (ok && r.Kind != tc.kind) {
			t.Errorf("Overlap(%d, %d) = %v, %v; want kind %v", tc.start, tc.end, r, ok, tc.kind)
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
		if r, ok := m.Overlap(want.off, want.off+1); !ok || r.Kind != want.kind {
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
	var mb metaBuilder
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

// TestMetadataWith checks the map's updates against a model: a byte-level
// array of kinds, after random insertions and removals.
func TestMetadataWith(t *testing.T) {
	const size = 4096
	r := rand.New(rand.NewPCG(1, 2))
	for round := 0; round < 200; round++ {
		model := make([]MetaKind, size)
		m := &MetadataMap{}
		for op := 0; op < 40; op++ {
			start := int64(r.IntN(size - 1))
			end := start + 1 + int64(r.IntN(min(size-int(start), 300)))
			kind := MetaKind(r.IntN(4)) // 0 removes
			m = m.with(start, end, kind)
			for i := start; i < end; i++ {
				model[i] = kind
			}
			// The map must be sorted, disjoint, without empty or
			// mergeable neighbours, and say what the model says.
			var got []MetaKind = make([]MetaKind, size)
			for k, x := range m.ranges {
				if x.Start >= x.End || x.Kind == 0 {
					t.Fatalf("round %d: bad range %+v", round, x)
				}
				if k > 0 {
					p := m.ranges[k-1]
					if p.End > x.Start || (p.End == x.Start && p.Kind == x.Kind) {
						t.Fatalf("round %d: ranges %+v and %+v overlap or should merge", round, p, x)
					}
				}
				for i := x.Start; i < x.End; i++ {
					got[i] = x.Kind
				}
			}
			for i := range model {
				if got[i] != model[i] {
					t.Fatalf("round %d op %d: byte %d is %v, model says %v", round, op, i, got[i], model[i])
				}
			}
		}
	}
}
