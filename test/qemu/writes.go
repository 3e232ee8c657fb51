package qemu

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"testing"
)

// The write matrix: images of every kind the read matrix has, made fresh
// for a test that writes them, and a seeded sequence of operations with a
// raw model to apply them to. The model starts as what qemu-img convert
// makes of the image, so after the operations, qemu-img convert of the
// written image must equal it.

// A WriteImage is an image to write, with what must not change.
type WriteImage struct {
	Image
	// Keep are files that must be unchanged afterwards: backing files
	// and their backing files.
	Keep []string
	// Snapshots are the image's internal snapshot names; each must read
	// the same afterwards.
	Snapshots []string
	// ClusterSize of the image.
	ClusterSize int64
	// Backed: the image has a backing file.
	Backed bool
	// V2: a compat 0.10 image (no zero clusters: zeroing over a backing
	// file writes zeros).
	V2 bool
}

// WriteMatrix makes, in dir, one image of every kind: compat 0.10 and 1.1
// at 512 B, 4 KiB, 64 KiB and 2 MiB clusters; extended L2 over a backing
// file; zlib and zstd compressed; a qcow2 -> qcow2 -> raw chain; internal
// snapshots; preallocation=metadata and falloc; external data files, raw
// and not; refcount_bits 1 and 64; lazy refcounts. Each holds data before
// it is written.
func WriteMatrix(t testing.TB, dir string) []WriteImage {
	t.Helper()
	var out []WriteImage
	add := func(name string, cs int64, opts ...string) *WriteImage {
		p := filepath.Join(dir, name+".qcow2")
		size := max(12<<20, 24*cs) + 3*512 // not a multiple of the cluster size
		Create(t, "qcow2", p, fmt.Sprint(size), append([]string{"-o", fmt.Sprintf("cluster_size=%d", cs)}, opts...)...)
		IO(t, p, patternWrites(int(cs), int(size))[:6]...)
		out = append(out, WriteImage{Image: Image{Name: name, Path: p}, ClusterSize: cs})
		return &out[len(out)-1]
	}
	for _, compat := range []string{"0.10", "1.1"} {
		for _, cs := range clusterSizes {
			add(fmt.Sprintf("w-v%s-c%d", map[string]string{"0.10": "2", "1.1": "3"}[compat], cs), int64(cs), "-o", "compat="+compat)
		}
	}
	add("w-refcount1", 65536, "-o", "refcount_bits=1")
	add("w-refcount64-c512", 512, "-o", "refcount_bits=64")
	add("w-lazy", 65536, "-o", "lazy_refcounts=on")
	add("w-prealloc-metadata", 65536, "-o", "preallocation=metadata")
	add("w-prealloc-falloc", 65536, "-o", "preallocation=falloc")

	// Extended L2 over a backing file, so that unallocated subclusters
	// show the backing file and copy-on-write copies from it.
	for _, cs := range []int64{16384, 65536, 2 << 20} {
		name := fmt.Sprintf("w-extl2-c%d", cs)
		base := filepath.Join(dir, name+"-base.qcow2")
		Create(t, "qcow2", base, "10M", "-o", fmt.Sprintf("cluster_size=%d", cs))
		IO(t, base, "write -P 0xaa 0 10M")
		p := filepath.Join(dir, name+".qcow2")
		Create(t, "qcow2", p, "12M", "-b", filepath.Base(base), "-F", "qcow2", "-o", fmt.Sprintf("extended_l2=on,cluster_size=%d", cs))
		sc := cs / 32
		IO(t, p, fmt.Sprintf("write -P 0x11 %d %d", sc, sc/2), fmt.Sprintf("write -z %d %d", 3*sc+100, 2*sc), fmt.Sprintf("discard %d %d", 2*cs, cs))
		out = append(out, WriteImage{Image: Image{Name: name, Path: p}, Keep: []string{base}, ClusterSize: cs, Backed: true})
	}

	// Compressed, and compressed then partly rewritten.
	raw := filepath.Join(dir, "w-patterns.raw")
	Create(t, "raw", raw, "12M")
	rawIO(t, raw, patternWrites(65536, 12<<20)...)
	for _, ct := range []string{"zlib", "zstd"} {
		p := filepath.Join(dir, "w-compressed-"+ct+".qcow2")
		Img(t, "convert", "-q", "-c", "-O", "qcow2", "-o", "compression_type="+ct, raw, p)
		IO(t, p, "write -P 0x77 100000 5000")
		out = append(out, WriteImage{Image: Image{Name: "w-compressed-" + ct, Path: p}, ClusterSize: 65536})
	}

	// A chain: raw <- qcow2 <- qcow2 (4 KiB clusters on top).
	base := filepath.Join(dir, "w-chain-base.raw")
	Create(t, "raw", base, "6M")
	rawIO(t, base, "write -P 0xb1 0 6M")
	mid := filepath.Join(dir, "w-chain-mid.qcow2")
	Create(t, "qcow2", mid, "10M", "-b", filepath.Base(base), "-F", "raw", "-o", "cluster_size=4096")
	IO(t, mid, "write -P 0xc2 1M 1M", "write -z 3M 64k")
	top := filepath.Join(dir, "w-chain-top.qcow2")
	Create(t, "qcow2", top, "12M", "-b", filepath.Base(mid), "-F", "qcow2")
	IO(t, top, "write -P 0xd4 2500000 70000")
	out = append(out, WriteImage{Image: Image{Name: "w-chain-top", Path: top}, Keep: []string{mid, base}, ClusterSize: 65536, Backed: true})
	// A compat 0.10 overlay: no zero clusters, so discards over the
	// backing file write zeros.
	v2top := filepath.Join(dir, "w-chain-v2.qcow2")
	Create(t, "qcow2", v2top, "12M", "-b", filepath.Base(mid), "-F", "qcow2", "-o", "compat=0.10,cluster_size=4096")
	out = append(out, WriteImage{Image: Image{Name: "w-chain-v2", Path: v2top}, Keep: []string{mid, base}, ClusterSize: 4096, Backed: true, V2: true})

	// Internal snapshots: clusters and L2 tables shared with them.
	snap := filepath.Join(dir, "w-snapshots.qcow2")
	Create(t, "qcow2", snap, "12M", "-o", "cluster_size=4096")
	IO(t, snap, "write -P 0x81 0 3M", "write -P 0x82 5M 64k")
	Img(t, "snapshot", "-c", "first", snap)
	IO(t, snap, "write -P 0x83 512k 1M")
	Img(t, "snapshot", "-c", "second", snap)
	out = append(out, WriteImage{Image: Image{Name: "w-snapshots", Path: snap}, Snapshots: []string{"first", "second"}, ClusterSize: 4096})

	// External data files.
	for _, rawData := range []string{"on", "off"} {
		name := "w-datafile-raw-" + rawData
		p := filepath.Join(dir, name+".qcow2")
		data := filepath.Join(dir, name+".data")
		Create(t, "qcow2", p, "12M", "-o", fmt.Sprintf("data_file=%s,data_file_raw=%s", data, rawData))
		IO(t, p, "write -P 0x71 4096 70000", "write -z 1M 64k")
		out = append(out, WriteImage{Image: Image{Name: name, Path: p}, ClusterSize: 65536})
	}
	return out
}

// OpKind is what an Op does.
type OpKind int

const (
	OpWrite OpKind = iota
	OpDiscard
	OpZero
	OpResize
	OpFlush
)

func (k OpKind) String() string {
	return [...]string{"write", "discard", "zero", "resize", "flush"}[k]
}

// An Op is one operation of a write sequence.
type Op struct {
	Kind OpKind
	Off  int64 // for OpResize: the new size
	Len  int64
	N    int // its number in the sequence, stamped into the data
}

func (o Op) String() string { return fmt.Sprintf("%d:%s(%d,+%d)", o.N, o.Kind, o.Off, o.Len) }

// Data is what an OpWrite writes: every 512-byte sector of the disk it
// covers carries its guest sector number and the op's number, so that data
// landing at the wrong offset, or an old value, is told from the right one.
func (o Op) Data() []byte {
	b := make([]byte, o.Len)
	for i := range b {
		pos := o.Off + int64(i)
		sector := pos / 512
		switch pos % 512 {
		case 0, 1, 2, 3, 4, 5, 6, 7:
			var w [8]byte
			binary.BigEndian.PutUint64(w[:], uint64(sector))
			b[i] = w[pos%512]
		case 8, 9, 10, 11:
			var w [4]byte
			binary.BigEndian.PutUint32(w[:], uint32(o.N))
			b[i] = w[pos%512-8]
		default:
			b[i] = byte(o.N*31 + int(pos%251))
		}
	}
	return b
}

// Apply applies o to the raw model of the disk and returns it.
func (o Op) Apply(model []byte) []byte {
	switch o.Kind {
	case OpWrite:
		copy(model[o.Off:], o.Data())
	case OpDiscard, OpZero:
		clear(model[o.Off : o.Off+o.Len])
	case OpResize:
		if o.Off > int64(len(model)) {
			model = append(model, make([]byte, o.Off-int64(len(model)))...)
		}
	}
	return model
}

// Ops returns a seeded sequence of n operations on a disk of size bytes
// with clusters of cs bytes: writes from 1 byte to 3 MiB at unaligned
// offsets and across clusters, whole-cluster and partial discards and
// zeroings, flushes, a write of the last byte, and one resize that grows
// the disk by 20 MiB (after which the ops use the larger size).
func Ops(seed uint64, n int, size, cs int64) []Op {
	r := rand.New(rand.NewPCG(seed, 7))
	var ops []Op
	resizeAt := n / 2
	for i := 0; i < n; i++ {
		op := Op{N: i + 1}
		switch {
		case i == resizeAt:
			size += 20 << 20
			op.Kind, op.Off = OpResize, size
		case i == n-1:
			op.Kind, op.Off, op.Len = OpWrite, size-1, 1
		default:
			switch k := r.IntN(10); {
			case k < 6:
				op.Kind = OpWrite
			case k < 8:
				op.Kind = OpDiscard
			case k < 9:
				op.Kind = OpZero
			default:
				op.Kind = OpFlush
			}
			op.Off = r.Int64N(size)
			switch r.IntN(4) {
			case 0:
				op.Len = 1 + r.Int64N(600)
			case 1:
				op.Off = op.Off / cs * cs
				op.Len = cs * (1 + r.Int64N(4))
			case 2:
				op.Len = 1 + r.Int64N(3<<20)
			default:
				op.Len = 1 + r.Int64N(2*cs)
			}
			op.Len = min(op.Len, size-op.Off)
		}
		ops = append(ops, op)
	}
	return ops
}
