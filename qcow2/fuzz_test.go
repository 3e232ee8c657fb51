package qcow2

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
	"time"
)

// Fuzz targets: whatever the bytes, parsing and reading never panic, never
// hang, and report malformed input as errors. Seeds are small qemu-made
// images. `make fuzz` runs each for a while; `make test` runs each
// briefly. Inputs that once failed are kept under testdata/fuzz and run as
// regression tests by every `go test`.

// seedImages makes a few small images with qemu-img, or none if qemu-img
// is missing (the fuzz targets then start from their plain seeds).
func seedImages(f *testing.F) [][]byte {
	if _, err := exec.LookPath("qemu-img"); err != nil {
		return nil
	}
	dir := f.TempDir()
	var out [][]byte
	run := func(args ...string) {
		if err := exec.Command(args[0], args[1:]...).Run(); err != nil {
			f.Fatalf("%v: %v", args, err)
		}
	}
	for i, opts := range []string{
		"cluster_size=512", "cluster_size=512,compat=0.10", "cluster_size=16384,extended_l2=on",
		"cluster_size=4096,compression_type=zstd", "cluster_size=4096,lazy_refcounts=on",
	} {
		p := filepath.Join(dir, "seed"+string(rune('a'+i))+".qcow2")
		run("qemu-img", "create", "-q", "-f", "qcow2", "-o", opts, p, "1M")
		run("qemu-io", "-f", "qcow2", "-c", "write -P 0x42 0 20k", "-c", "write -c -P 0x43 64k 16k", "-c", "write -z 32k 8k", p)
		if i == 0 {
			run("qemu-img", "snapshot", "-c", "snap", p)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		out = append(out, b)
	}
	return out
}

// FuzzHeader parses arbitrary first clusters as headers.
func FuzzHeader(f *testing.F) {
	for _, b := range seedImages(f) {
		f.Add(b[:min(len(b), 4096)])
	}
	f.Add([]byte("QFI\xfb"))
	// Every 8- and 4-byte header field near the top of its range (the
	// sums a parser forms from them must not wrap).
	for _, b := range seedImages(f) {
		for _, fl := range edgeFields {
			for _, v := range []uint64{^uint64(0), 0xffffffffffff0000} {
				f.Add(patchedCopy(b[:min(len(b), 4096)], fl.off, fl.width, v))
			}
		}
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		h, err := readHeader(ReaderFile(bytes.NewReader(data), int64(len(data)), "fuzz"), int64(len(data)))
		if err != nil {
			if !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrUnsupported) && !errors.Is(err, ErrNotQcow2) {
				t.Fatalf("unclassified error: %v", err)
			}
			return
		}
		if h.ClusterBits < minClusterBits || h.ClusterBits > maxClusterBits || uint64(h.L1Size)*8 > maxL1Bytes {
			t.Fatalf("accepted an out-of-range header: %+v", h)
		}
	})
}

// edgeFields are the header fields whose values near 2^64 (or 2^32) the
// hostile tests tried: offsets and sizes a parser adds to.
var edgeFields = []headerField{
	fieldBackingFileOffset, fieldBackingFileSize, fieldSize, fieldL1Size, fieldL1TableOffset,
	fieldRefcountTableOffset, fieldRefcountTableClusters, fieldNbSnapshots, fieldSnapshotsOffset,
	fieldHeaderLength, fieldRefcountOrder, fieldClusterBits,
}

// patchedCopy returns b with the big-endian field of width bytes at off
// set to v.
func patchedCopy(b []byte, off int64, width int, v uint64) []byte {
	c := append([]byte(nil), b...)
	if int(off)+width > len(c) {
		return c
	}
	for i := 0; i < width; i++ {
		c[int(off)+width-1-i] = byte(v >> (8 * i))
	}
	return c
}

// hostileSeeds are whole images with the damage the hostile tests found
// worth trying: every L1 entry naming the first L2 table, a snapshot name
// of 65,535 bytes, snapshot disk sizes of 2^62 and of an odd number of
// bytes, a size field that is not a whole number of sectors, and header
// fields near 2^64.
func hostileSeeds(b []byte) [][]byte {
	be := binary.BigEndian
	if len(b) < 104 {
		return nil
	}
	var out [][]byte
	l1, l1Size := int64(be.Uint64(b[40:])), int64(be.Uint32(b[36:]))
	if l1 > 0 && l1+8*l1Size <= int64(len(b)) {
		c := append([]byte(nil), b...)
		for i := int64(1); i < l1Size; i++ {
			copy(c[l1+8*i:], c[l1:l1+8])
		}
		out = append(out, c)
	}
	if n, sn := be.Uint32(b[60:]), int64(be.Uint64(b[64:])); n > 0 && sn+64 <= int64(len(b)) {
		out = append(out, patchedCopy(b, sn+14, 2, 0xffff), patchedCopy(b, sn+48, 8, 1<<62), patchedCopy(b, sn+48, 8, 1<<20+123))
	}
	out = append(out, patchedCopy(b, fieldSize.off, 8, 1<<20+123))
	for _, fl := range edgeFields {
		out = append(out, patchedCopy(b, fl.off, fl.width, ^uint64(0)))
	}
	return out
}

// FuzzImage opens arbitrary files as images and reads them (see exercise),
// and every snapshot of them. Inputs are whole images, so run it with a
// short -fuzzminimizetime: minimizing a 100 KB input takes long.
func FuzzImage(f *testing.F) {
	for i, b := range seedImages(f) {
		f.Add(b)
		if i == 0 {
			for _, h := range hostileSeeds(b) {
				f.Add(h)
			}
		}
	}
	// Inputs go to a file in memory (tmpfs) where there is one: on a disk,
	// the write of every input and the FIEMAP sync after it dominate.
	dir := f.TempDir()
	if d, err := os.MkdirTemp("/dev/shm", "qcowfs-fuzz"); err == nil {
		dir = d
		f.Cleanup(func() { os.RemoveAll(d) })
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		p := filepath.Join(dir, "fuzz.qcow2")
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
		// A hang is a bug too: crash (so the fuzzer keeps the input)
		// if one exec takes more than a few seconds.
		done := make(chan struct{})
		defer close(done)
		go func() {
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				buf := make([]byte, 1<<20)
				panic("FuzzImage: an input hung the reader:\n" + string(buf[:runtime.Stack(buf, true)]))
			}
		}()
		img, err := Open(p, Options{Cache: NewCache(1<<20, 1<<20), AllowedDirs: []string{dir}})
		if err != nil {
			return
		}
		defer img.Close()
		exercise(img)
		for _, s := range img.Snapshots() {
			si, err := Open(p, Options{Snapshot: s.ID, AllowedDirs: []string{dir}})
			if err == nil {
				exercise(si)
				si.Close()
			}
		}
	})
}

// exercise reads and walks a bounded part of an image: the first 256 KiB,
// a few far offsets, up to 64 data runs and 64 map entries.
func exercise(img *Image) {
	buf := make([]byte, 64<<10)
	for off := int64(0); off < min(img.Size(), 256<<10); off += int64(len(buf)) {
		img.ReadAt(buf, off)
	}
	for _, off := range []int64{img.Size() / 2, img.Size() - 1, img.Size() - 5000} {
		if off >= 0 {
			img.ReadAt(buf[:4096], off)
		}
	}
	n := 0
	for off := int64(0); off < img.Size() && n < 64; n++ {
		d, err := img.NextData(context.Background(), off)
		if err != nil {
			break
		}
		h, err := img.NextHole(context.Background(), d)
		if err != nil || h <= d {
			break
		}
		off = h
	}
	img.Map(context.Background(), func(MapEntry) error {
		n++
		if n > 128 {
			return errors.New("enough")
		}
		return nil
	})
}

// FuzzL2Entry classifies arbitrary L2 entries and decodes compressed
// descriptors, for every cluster size and both entry formats.
func FuzzL2Entry(f *testing.F) {
	f.Add(uint64(0x8000000000050000), uint64(0), uint8(16), false, uint8(0))
	f.Add(uint64(0x4000000000012345), uint64(0xffff), uint8(12), true, uint8(31))
	f.Add(uint64(0x1), uint64(0x00000001ffffffff), uint8(21), true, uint8(3))
	f.Fuzz(func(t *testing.T, word, bitmap uint64, bits uint8, extended bool, sc uint8) {
		bits = minClusterBits + bits%(maxClusterBits-minClusterBits+1)
		if extended && bits < 14 {
			bits = 14
		}
		e := l2Entry{word: word, bitmap: bitmap}
		k, ok := e.subclusterKind(int(sc%subclustersPerCluster), extended, false)
		if !ok {
			return
		}
		if k == kindCompressed {
			off, size := l2Entry{word: word}.compressedRange(uint(bits))
			if off < 0 || size <= 0 || size > 2<<bits {
				t.Fatalf("compressed range %d, %d for cluster_bits %d", off, size, bits)
			}
		}
	})
}

// FuzzDecompress inflates arbitrary data as deflate and zstd clusters.
func FuzzDecompress(f *testing.F) {
	f.Add([]byte{0x03, 0x00}, false)
	f.Add([]byte{0x28, 0xb5, 0x2f, 0xfd}, true)
	f.Fuzz(func(t *testing.T, src []byte, zstd bool) {
		typ := uint8(compressionDeflate)
		if zstd {
			typ = compressionZstd
		}
		d := newDecompressor(typ, 4096)
		dst := make([]byte, 4096)
		d.decompress(dst, src)
	})
}

// FuzzSnapshotTable parses arbitrary snapshot tables.
func FuzzSnapshotTable(f *testing.F) {
	f.Add([]byte{}, uint32(1))
	f.Add(bytes.Repeat([]byte{0}, 48), uint32(1))
	// An entry whose name runs 65,535 bytes; one whose disk size is 2^62;
	// extra data at qemu's limit; 65,535 entries of 64 bytes.
	entry := func(idLen, nameLen uint16, extra uint32, disk uint64) []byte {
		e := make([]byte, 40+int(extra))
		binary.BigEndian.PutUint16(e[12:], idLen)
		binary.BigEndian.PutUint16(e[14:], nameLen)
		binary.BigEndian.PutUint32(e[36:], extra)
		if extra >= 16 {
			binary.BigEndian.PutUint64(e[48:], disk)
		}
		return append(e, bytes.Repeat([]byte{'x'}, int(idLen)+int(nameLen))...)
	}
	f.Add(entry(1, 0xffff, 24, 1<<30), uint32(1))
	f.Add(entry(1, 1, 24, 1<<62), uint32(1))
	f.Add(entry(1, 1, 1024, 1<<30), uint32(1))
	f.Add(bytes.Repeat(entry(2, 14, 8, 0), 65535), uint32(65535))
	f.Fuzz(func(t *testing.T, table []byte, n uint32) {
		h := &Header{ClusterBits: 16, Size: 1 << 30, NbSnapshots: n % (maxSnapshots + 1)}
		file := append(make([]byte, 65536), table...)
		h.SnapshotsOffset = 65536
		snaps, _, err := readSnapshots(&metaFile{f: ReaderFile(bytes.NewReader(file), int64(len(file)), "fuzz"), size: int64(len(file)), clusterSize: h.ClusterSize()}, h, 1<<30, newCharge(NewBudget(DefaultBudget), "fuzz"))
		if err != nil {
			return
		}
		for _, s := range snaps {
			if s.Err == nil && s.L1Size > 0 && s.L1TableOffset+uint64(s.L1Size)*8 > uint64(len(file)) {
				t.Fatalf("accepted a snapshot L1 table past the end: %+v", s)
			}
		}
	})
}
