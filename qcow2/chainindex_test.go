package qcow2_test

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"testing"

	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// randomChain makes a backing chain of depth images over a disk of about
// 4 MiB with qemu: each layer with its own cluster size (512 B to 64 KiB,
// some with extended L2), some shorter than the one above (reads past a
// shorter backing file are zeros), sometimes a raw file at the bottom; and
// in each layer, with qemu-io, data, zero clusters, discards and
// compressed clusters at random places. It returns the top image.
func randomChain(t *testing.T, r *rand.Rand, dir string, depth int) string {
	t.Helper()
	prev, prevFmt := "", ""
	for k := range depth {
		cs := int64(512) << r.IntN(8) // 512 B .. 64 KiB
		opts := fmt.Sprintf("cluster_size=%d", cs)
		if cs >= 16384 && r.IntN(3) == 0 {
			opts += ",extended_l2=on"
		}
		size := int64(3<<20 + r.IntN(3)*512<<10 + r.IntN(4)*4096 + r.IntN(2)*512)
		if k == depth-1 {
			size = 4 << 20 // the top: the largest
		}
		p := filepath.Join(dir, fmt.Sprintf("l%02d.qcow2", k))
		switch {
		case k == 0 && depth > 1 && r.IntN(4) == 0:
			p = filepath.Join(dir, "base.raw")
			qemu.Create(t, "raw", p, fmt.Sprint(size))
			qemu.Run(t, "qemu-io", "-f", "raw", "-c", fmt.Sprintf("write -P 0x%x 0 %d", 0x30+r.IntN(64), size/2), p)
			prev, prevFmt = p, "raw"
			continue
		case prev == "":
			qemu.Create(t, "qcow2", p, fmt.Sprint(size), "-o", opts)
		default:
			qemu.Create(t, "qcow2", p, fmt.Sprint(size), "-o", opts, "-b", filepath.Base(prev), "-F", prevFmt)
		}
		// Compressed writes first, each to a cluster of its own: qemu
		// refuses one over an allocated cluster.
		var cmds, compressed []string
		used := map[int64]bool{}
		for range 1 + r.IntN(12) {
			off := r.Int64N(size/512) * 512
			n := min(size-off, 512*(1+r.Int64N(256)))
			switch r.IntN(5) {
			case 0, 1:
				cmds = append(cmds, fmt.Sprintf("write -P 0x%x %d %d", 1+r.IntN(250), off, n))
			case 2:
				cmds = append(cmds, fmt.Sprintf("write -z %d %d", off, n))
			case 3:
				cmds = append(cmds, fmt.Sprintf("discard %d %d", off, n))
			default:
				off = off / cs * cs // compressed writes are whole clusters
				if off+cs <= size && !used[off] {
					used[off] = true
					compressed = append(compressed, fmt.Sprintf("write -c -P 0x%x %d %d", 1+r.IntN(250), off, cs))
				}
			}
		}
		qemu.IO(t, p, append(compressed, cmds...)...)
		prev, prevFmt = p, "qcow2"
	}
	return prev
}

// TestChainIndexRandom checks reads and block status through random
// chains of depth 1 to 64 (randomChain) against qemu: every byte as
// qemu-img convert reads it, every extent's depth, data and zero status as
// qemu-img map says; then random writes, zero-writes and discards through
// the top image, each followed by reads of the whole disk against a raw
// model, and at the end qemu-img convert of the written chain against the
// model. The index decides which layer is asked; a wrong depth reads the
// wrong layer's bytes. QCOWFS_CHAIN_SEEDS=N runs more seeds.
func TestChainIndexRandom(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	t.Parallel()
	seeds := envInt(t, "QCOWFS_CHAIN_SEEDS", 1)
	for seed := range seeds {
		for _, depth := range []int{1, 3, 9, 17, 64} {
			t.Run(fmt.Sprintf("depth%d/seed%d", depth, seed), func(t *testing.T) {
				t.Parallel()
				r := rand.New(rand.NewPCG(uint64(seed), uint64(depth)))
				dir := qemu.TempDir(t)
				top := randomChain(t, r, dir, depth)
				checkChain(t, r, top)
			})
		}
	}
}

func checkChain(t *testing.T, r *rand.Rand, top string) {
	want := qemu.RawBytes(t, top)
	// A small cache, so that index chunks and tables are evicted and
	// built again while the test reads.
	f, err := qcow2.OpenWritableFile(top)
	if err != nil {
		t.Fatal(err)
	}
	img, err := qcow2.NewImage(f, qcow2.Options{Writable: true, Cache: qcow2.NewCache(64<<10, 1<<20)})
	if err != nil || !img.Writable() {
		t.Fatalf("open: %v %s", err, img.ReadOnlyReason())
	}
	defer img.Close()
	// Reads in random order and sizes, twice (the second time from the
	// index).
	for pass := range 2 {
		readAgainst(t, r, img, want, fmt.Sprintf("pass %d", pass))
	}
	// Block status against qemu-img map.
	for _, m := range qemu.Map(t, top) {
		for off := m.Start; off < m.Start+m.Length; {
			e, err := img.Extent(off, m.Start+m.Length-off)
			if err != nil {
				t.Fatal(err)
			}
			// (Whether an allocated data cluster also reads as zeros
			// depends on probing the host file, which both do only
			// for images that look preallocated, by a count of
			// allocated host blocks taken at different moments: the
			// zero bit of data is not compared.)
			data := e.Status&qcow2.StatusData != 0
			if e.Depth != m.Depth || data != m.Data || !data && (e.Status&qcow2.StatusZero != 0) != m.Zero {
				t.Fatalf("extent at %d: depth %d status %v; qemu-img map: depth %d data %v zero %v", off, e.Depth, e.Status, m.Depth, m.Data, m.Zero)
			}
			off += e.Length
		}
	}
	// Writes through the top, reads between them.
	model := bytes.Clone(want)
	size := int64(len(model))
	for i := range 12 {
		off := r.Int64N(size)
		n := min(size-off, 1+r.Int64N(256<<10))
		switch r.IntN(3) {
		case 0:
			d := make([]byte, n)
			for j := range d {
				d[j] = byte(i*37 + j%251)
			}
			if _, err := img.WriteAt(d, off); err != nil {
				t.Fatal(err)
			}
			copy(model[off:], d)
		case 1:
			off, n = off/512*512, (n+511)/512*512
			n = min(n, size-off)
			if err := img.WriteZeroes(off, n); err != nil {
				t.Fatal(err)
			}
			clear(model[off : off+n])
		default:
			off, n = off/512*512, (n+511)/512*512
			n = min(n, size-off)
			if err := img.Discard(off, n); err != nil {
				t.Fatal(err)
			}
			// A discard of the top shows the backing chain again,
			// or zeros: whatever qemu reads after it is checked
			// below; the model takes what the image says now.
			if _, err := img.ReadAt(model[off:off+n], off); err != nil {
				t.Fatal(err)
			}
		}
		readAgainst(t, r, img, model, fmt.Sprintf("after write %d", i))
	}
	if err := img.Close(); err != nil {
		t.Fatal(err)
	}
	qemu.CheckClean(t, top)
	if got := qemu.RawBytes(t, top); !bytes.Equal(got, model) {
		t.Fatalf("qemu-img convert after the writes differs from the model at byte %d", firstDiff(got, model))
	}
}

// readAgainst reads the whole image in random pieces and compares.
func readAgainst(t *testing.T, r *rand.Rand, img *qcow2.Image, want []byte, what string) {
	t.Helper()
	size := int64(len(want))
	if img.Size() != size {
		t.Fatalf("%s: size %d, want %d", what, img.Size(), size)
	}
	buf := make([]byte, 128<<10)
	for off := int64(0); off < size; {
		n := min(size-off, 1+r.Int64N(int64(len(buf))))
		if _, err := img.ReadAt(buf[:n], off); err != nil {
			t.Fatalf("%s: read %d at %d: %v", what, n, off, err)
		}
		if !bytes.Equal(buf[:n], want[off:off+n]) {
			t.Fatalf("%s: read %d at %d differs at byte %d", what, n, off, off+int64(firstDiff(buf[:n], want[off:off+n])))
		}
		off += n
	}
}
