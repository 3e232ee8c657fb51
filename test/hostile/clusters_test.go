package hostile

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestCorruptCompressedCluster: a compressed cluster with a broken deflate
// stream, and one whose descriptor points past the end of the file, fail
// that read with EIO (qemu fails them too); the rest of the image and the
// other images of the mount read correctly, and the daemon logs the
// failure once per image.
func TestCorruptCompressedCluster(t *testing.T) {
	src := harness.SourceDir(t)
	raw := filepath.Join(src, "text.raw")
	var text bytes.Buffer
	for i := 0; text.Len() < 4<<20; i++ {
		text.WriteString(strings.Repeat("qcowfs compressed cluster test line ", 3) + string(rune('a'+i%26)) + "\n")
	}
	os.WriteFile(raw, text.Bytes()[:4<<20], 0o644)
	const cs = 65536
	good := filepath.Join(src, "good.qcow2")
	qemu.Img(t, "convert", "-q", "-c", "-O", "qcow2", raw, good)
	pristine := qemu.ToRaw(t, good, filepath.Join(t.TempDir(), "pristine.raw"))

	// badstream: the compressed bytes of cluster 3 overwritten.
	bad := filepath.Join(src, "badstream.qcow2")
	qemu.Run(t, "cp", good, bad)
	_, e := qemu.L2EntryOffset(t, bad, 3)
	if e&(1<<62) == 0 {
		t.Fatalf("cluster 3 is not compressed: L2 entry %#x", e)
	}
	x := uint(62 - (16 - 8)) // cluster_bits 16
	coff := int64(e & (1<<x - 1))
	qemu.WriteAt(t, bad, coff, bytes.Repeat([]byte{0xff}, 64))

	// pasteof: cluster 3's descriptor points past the end of the file.
	past := filepath.Join(src, "pasteof.qcow2")
	qemu.Run(t, "cp", good, past)
	at, e := qemu.L2EntryOffset(t, past, 3)
	var nb [8]byte
	binary.BigEndian.PutUint64(nb[:], e&^(1<<x-1)|(1<<40))
	qemu.WriteAt(t, past, at, nb[:])

	// The oracle: qemu cannot read those clusters either.
	for _, p := range []string{bad, past} {
		r := harness.Exec(t, "qemu-io", "-f", "qcow2", "-c", "read 196608 65536", p)
		if !strings.Contains(r.Stdout+r.Stderr, "Input/output error") {
			t.Fatalf("qemu-io reads the damaged cluster of %s: %s%s", p, r.Stdout, r.Stderr)
		}
	}

	m := harness.Mount(t, src)
	want, err := os.ReadFile(pristine)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"badstream", "pasteof"} {
		f := harness.Open(t, filepath.Join(m.Dir, name+".raw"))
		buf := make([]byte, cs)
		for i := 0; i < 3; i++ {
			if _, err := f.ReadAt(buf[:4096], 3*cs+8192); !errors.Is(err, unix.EIO) {
				t.Errorf("%s: reading the damaged cluster: %v, want EIO", name, err)
			}
		}
		for _, c := range []int64{0, 2, 4, 40} {
			if _, err := f.ReadAt(buf, c*cs); err != nil || !bytes.Equal(buf, want[c*cs:(c+1)*cs]) {
				t.Errorf("%s: cluster %d: %v, or bytes differ from qemu", name, c, err)
			}
		}
		f.Close()
		if n := harness.CountLines(m.LogText(t), name+".qcow2"); n != 1 {
			t.Errorf("want one log line for %s, got %d:\n%s", name, n, m.LogText(t))
		}
	}
	harness.SameFile(t, filepath.Join(m.Dir, "good.raw"), pristine)
}

// TestHostileMetadataAsData: L2 entries that place guest data in the
// image's own metadata (a refcount block, the snapshot table, the bitmap
// directory), and a compressed stream in the header cluster. Each such
// read fails with EIO (qemu-img check reports each image corrupt, the
// oracle for "this is metadata"), intact clusters read, and an image
// whose metadata map does not fit in --metadata-memory is not shown, with
// a line naming the flag.
func TestHostileMetadataAsData(t *testing.T) {
	src := harness.SourceDir(t)
	tmpl := qemu.Make(t, filepath.Join(t.TempDir(), "tmpl.qcow2"), "8M", "write -P 0x41 0 1M", "write -c -P 0x42 1M 64k")
	qemu.Img(t, "snapshot", "-c", "s", tmpl)
	qemu.Img(t, "bitmap", "--add", tmpl, "b")
	_, _, dirOff, _ := qemu.BitmapDirectory(t, tmpl)
	rt := int64(qemu.ReadU(t, tmpl, qemu.HeaderRefcountTableOffset, 8))
	refblock := int64(qemu.ReadU(t, tmpl, rt, 8) &^ 0x1ff)
	targets := map[string]int64{
		"into-refcount-block":   refblock,
		"into-snapshot-table":   int64(qemu.ReadU(t, tmpl, qemu.HeaderSnapshotsOffset, 8)),
		"into-bitmap-directory": dirOff,
	}
	var hostile []string
	for name, host := range targets {
		p := filepath.Join(src, name+".qcow2")
		qemu.Run(t, "cp", tmpl, p)
		// Cluster 2 of the active L2 table (a copy, since the snapshot
		// shares the original).
		at, e := qemu.L2EntryOffset(t, p, 2)
		qemu.PatchU(t, p, at, 8, e&^qemu.OffsetMask|uint64(host))
		hostile = append(hostile, p)
	}
	cp := filepath.Join(src, "compressed-in-header.qcow2")
	qemu.Run(t, "cp", tmpl, cp)
	at, e := qemu.L2EntryOffset(t, cp, 16) // the compressed cluster at 1 MiB
	const x = 62 - (16 - 8)
	qemu.PatchU(t, cp, at, 8, e&^(1<<x-1)|0x200)
	hostile = append(hostile, cp)
	for _, p := range hostile {
		if r := harness.Exec(t, "qemu-img", "check", p); r.Code == 0 {
			t.Fatalf("qemu-img check finds nothing wrong with %s:\n%s", filepath.Base(p), r.Stdout)
		}
	}
	// An image whose L1 table alone (2 MiB: a 128 TiB disk) is more than
	// the budget the mount is given.
	big := filepath.Join(src, "big.qcow2")
	qemu.Create(t, "qcow2", big, "128T")
	makeCanary(t, src)

	m := harness.Mount(t, src, "--metadata-memory=1M")
	listed := listWithin(t, m.Dir, 20*time.Second)
	for _, p := range hostile {
		raw := filepath.Join(m.Dir, strings.TrimSuffix(filepath.Base(p), ".qcow2")+".raw")
		f, err := os.Open(raw)
		if err != nil {
			t.Errorf("%s: %v", raw, err)
			continue
		}
		off := int64(2 << 16)
		if strings.Contains(p, "compressed") {
			off = 1 << 20
		}
		_, err = harness.Within(t, "reading "+raw, 10*time.Second, func() (int, error) { return f.ReadAt(make([]byte, 4096), off) })
		if !errIs(err, unix.EIO) {
			t.Errorf("%s: reading the cluster in metadata: %v, want EIO", filepath.Base(raw), err)
		}
		b := make([]byte, 4096)
		if _, err := f.ReadAt(b, 0); err != nil || b[0] != 0x41 {
			t.Errorf("%s: reading an intact cluster: %v", filepath.Base(raw), err)
		}
		f.Close()
	}
	if slices.Contains(listed, "big.raw") {
		t.Errorf("big.raw is shown; its L1 table is more than the mount's metadata memory")
	}
	log := m.LogText(t)
	if !strings.Contains(log, "image="+big) || !strings.Contains(log, "--metadata-memory") {
		t.Errorf("no log line refuses big.qcow2 naming --metadata-memory:\n%s", log)
	}
	checkCanary(t, m.Dir)
	m.NoPanics(t)
	boundedAll(t, append(hostile, big))
}

// TestZstdHugeWindow: a zstd image whose compressed clusters are frames
// declaring a 512 MiB window (re-encoded from qemu's own, so that each still
// decodes to its cluster with enough memory) is read by 8 parallel
// readers: each read fails with EIO (a frame may need no more than a
// cluster), and the daemon's peak memory stays within its caches and a
// fixed margin. Other images of the mount read on.
func TestZstdHugeWindow(t *testing.T) {
	harness.RequireFUSE(t)
	src := t.TempDir()
	raw := filepath.Join(src, "data.bin")
	qemu.Create(t, "raw", raw, "4M")
	qemu.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x5a 0 4M", raw)
	p := filepath.Join(src, "huge.qcow2")
	qemu.Img(t, "convert", "-c", "-O", "qcow2", "-o", "compression_type=zstd,cluster_size=65536", raw, p)
	good := filepath.Join(src, "good.qcow2")
	qemu.Img(t, "convert", "-c", "-O", "qcow2", "-o", "compression_type=zstd", raw, good)
	os.Remove(raw)

	// Every compressed cluster of the first L2 table (64 of them) gets
	// a frame declaring a 512 MiB window (the encoder's, patched),
	// appended to the file.
	const x = 62 - (16 - 8)
	enc, err := zstd.NewWriter(nil, zstd.WithWindowSize(512<<20), zstd.WithSingleSegment(false))
	if err != nil {
		t.Fatal(err)
	}
	dec, _ := zstd.NewReader(nil)
	f := harness.OpenFile(t, p, os.O_RDWR)
	st, _ := f.Stat()
	end := (st.Size() + 511) &^ 511
	for n := int64(0); n < 64; n++ {
		at, e := qemu.L2EntryOffset(t, p, n)
		if e&(1<<62) == 0 {
			t.Fatalf("cluster %d is not compressed: %#x", n, e)
		}
		off := int64(e & (1<<x - 1))
		sectors := int64((e>>x)&0xff) + 1
		in := make([]byte, sectors*512-off&511)
		f.ReadAt(in, off)
		cluster, err := dec.DecodeAll(in, nil)
		if err != nil && len(cluster) < 65536 {
			t.Fatalf("cluster %d: %v", n, err)
		}
		frame := enc.EncodeAll(cluster[:65536], nil)
		frame[5] = 19 << 3 // the window descriptor: 2^(10+19) bytes
		if _, err := f.WriteAt(frame, end); err != nil {
			t.Fatal(err)
		}
		qemu.PatchU(t, p, at, 8, 1<<62|uint64((len(frame)+511)/512-1)<<x|uint64(end))
		end = (end + int64(len(frame)) + 511) &^ 511
	}
	f.Truncate(end)
	f.Close()

	m := harness.Racy.Mount(t, src)
	pid := m.PID(t)
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Go(func() {
			g, err := os.OpenFile(filepath.Join(m.Dir, "huge.raw"), os.O_RDONLY|unix.O_DIRECT, 0)
			if err != nil {
				errs[i] = err
				return
			}
			defer g.Close()
			buf := harness.AlignedBlock(t, 1<<20)
			for off := int64(i%4) << 20; off < 4<<20; off += 1 << 20 {
				if _, err := g.ReadAt(buf, off); !errors.Is(err, unix.EIO) {
					errs[i] = fmt.Errorf("read at %d: %v", off, err)
					return
				}
			}
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("reader %d: %v, want EIO", i, err)
		}
	}
	ps := harness.ReadProc(t, pid)
	// The default caches: L2 32M, clusters 64M, and go-fuse's buffers.
	if limit := harness.MemBound(96 + 160); ps.HWMKB > limit {
		t.Errorf("the daemon's peak memory is %d MiB, over %d MiB: %v", ps.HWMKB>>10, limit>>10, ps)
	}
	want, _ := os.ReadFile(qemu.ToRaw(t, good, filepath.Join(t.TempDir(), "good.raw")))
	got, err := os.ReadFile(filepath.Join(m.Dir, "good.raw"))
	if err != nil || !bytes.Equal(got, want) {
		t.Errorf("another image of the mount: %v, equal %v", err, bytes.Equal(got, want))
	}
	m.NoPanics(t)
}
