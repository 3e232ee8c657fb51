package qcow2_test

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// compressedClusters asks qemu-img check how many clusters are compressed.
func compressedClusters(t *testing.T, image string) int64 {
	var c struct {
		Compressed int64 `json:"compressed-clusters"`
	}
	if err := json.Unmarshal(qemu.Img(t, "check", "--output=json", image), &c); err != nil {
		t.Fatal(err)
	}
	return c.Compressed
}

// TestCompressedBoundaries reads compressed images at every interesting
// offset and size around cluster boundaries, and checks the bytes against
// qemu-img convert.
func TestCompressedBoundaries(t *testing.T) {
	dir := qemu.TempDir(t)
	for _, im := range qemu.Matrix(t, dir) {
		if !strings.HasPrefix(im.Name, "compressed") {
			continue
		}
		t.Run(im.Name, func(t *testing.T) {
			want, err := os.ReadFile(qemu.ToRaw(t, im.Path, filepath.Join(t.TempDir(), "raw")))
			if err != nil {
				t.Fatal(err)
			}
			cs := int64(qemu.Info(t, im.Path)["cluster-size"].(float64))
			img, err := qcow2.Open(im.Path, qcow2.Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer img.Close()
			buf := make([]byte, 3*cs+16)
			for _, base := range []int64{0, cs, 7 * cs, 33 * cs, int64(len(want)) - 2*cs} {
				for _, d := range []int64{0, 1, cs - 1, cs - 4096, cs - 7} {
					for _, n := range []int64{1, 7, 4095, 4096, 4097, cs - 1, cs, cs + 1, 2*cs + 3} {
						off := base + d
						if off < 0 || off+n > int64(len(want)) {
							continue
						}
						if _, err := img.ReadAt(buf[:n], off); err != nil {
							t.Fatalf("ReadAt(%d, %d): %v", off, n, err)
						}
						if !bytes.Equal(buf[:n], want[off:off+n]) {
							t.Fatalf("ReadAt(%d, %d) differs from qemu-img convert", off, n)
						}
					}
				}
			}
		})
	}
}

// TestInflateOnce: 4 KiB reads through a compressed image inflate each
// compressed cluster once (qemu-img check counts them), and the host reads
// of the compressed data are far fewer than the clusters (readahead).
func TestInflateOnce(t *testing.T) {
	dir := qemu.TempDir(t)
	raw := filepath.Join(dir, "data.raw")
	qemu.Create(t, "raw", raw, "16M")
	qemu.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x41 0 16M", raw)
	for _, ct := range []string{"zlib", "zstd"} {
		t.Run(ct, func(t *testing.T) {
			p := filepath.Join(dir, ct+".qcow2")
			qemu.Img(t, "convert", "-q", "-c", "-O", "qcow2", "-o", "compression_type="+ct, raw, p)
			want := compressedClusters(t, p)
			img, err := qcow2.Open(p, qcow2.Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer img.Close()
			buf := make([]byte, 4096)
			for off := int64(0); off < img.Size(); off += 4096 {
				if _, err := img.ReadAt(buf, off); err != nil {
					t.Fatal(err)
				}
			}
			s := img.Stats()
			if s.Inflates != want {
				t.Errorf("%d inflates for %d compressed clusters (qemu-img check)", s.Inflates, want)
			}
			if ratio := float64(s.HostReads) / float64(s.Inflates); ratio >= 0.1 {
				t.Errorf("%d host reads for %d compressed clusters: %.2f per cluster", s.HostReads, s.Inflates, ratio)
			}
			t.Logf("%+v", s)
		})
	}
}

// mixedImage makes a zstd image of 4 MiB, compressed by qemu-img convert
// and then 1 MiB of it rewritten uncompressed, and returns it with where
// qemu-img map places uncompressed and compressed data (no host offset).
func mixedImage(t *testing.T) (path string, plain, compressed []int64) {
	t.Helper()
	dir := qemu.TempDir(t)
	raw := filepath.Join(dir, "data.raw")
	qemu.Create(t, "raw", raw, "4M")
	qemu.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x41 0 4M", raw)
	path = filepath.Join(dir, "mixed.qcow2")
	qemu.Img(t, "convert", "-q", "-c", "-O", "qcow2", "-o", "compression_type=zstd", raw, path)
	qemu.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x42 1M 1M", path)
	for _, e := range qemu.Map(t, path) {
		switch {
		case e.Data && e.Offset == nil:
			compressed = append(compressed, e.Start)
		case e.Data:
			plain = append(plain, e.Start)
		}
	}
	if len(plain) == 0 || len(compressed) == 0 {
		t.Fatalf("qemu-img map: uncompressed data at %v, compressed at %v: want both", plain, compressed)
	}
	return path, plain, compressed
}

// TestWhenInflating: the Cache's WhenInflating hook runs once, at the
// first compressed cluster read, and not for reads of uncompressed data
// (qemu-img map gives no host offset for compressed data).
func TestWhenInflating(t *testing.T) {
	p, plain, compressed := mixedImage(t)
	if len(compressed) < 2 {
		t.Fatalf("qemu-img map: compressed data at %v: want two extents", compressed)
	}
	cache := qcow2.NewCache(qcow2.DefaultCacheSize, 1<<20)
	var calls int
	cache.WhenInflating(func() { calls++ })
	img, err := qcow2.Open(p, qcow2.Options{Cache: cache})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	buf := make([]byte, 4096)
	read := func(off int64) {
		t.Helper()
		if _, err := img.ReadAt(buf, off); err != nil {
			t.Fatal(err)
		}
	}
	for _, off := range plain {
		read(off)
	}
	if calls != 0 {
		t.Fatalf("the hook ran %d times after reads of uncompressed data only", calls)
	}
	for _, off := range compressed {
		read(off)
	}
	read(compressed[0] + 64<<10)
	if calls != 1 {
		t.Errorf("the hook ran %d times after reads of %d compressed extents, want once", calls, len(compressed))
	}
}

// TestReadAllocs: a 4 KiB read of an uncompressed cluster, and of a
// compressed cluster already inflated, allocates nothing (issue 33: no
// allocation per request). The extents are told apart by qemu-img map.
func TestReadAllocs(t *testing.T) {
	p, plainAt, compressedAt := mixedImage(t)
	plain, compressed := plainAt[0], compressedAt[0]
	img, err := qcow2.Open(p, qcow2.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	buf := make([]byte, 4096)
	for _, off := range []int64{plain, compressed + 8192} {
		read := func() {
			if _, err := img.ReadAt(buf, off); err != nil {
				t.Fatal(err)
			}
		}
		read() // loads the L2 table, inflates the cluster
		if a := testing.AllocsPerRun(100, read); a != 0 {
			t.Errorf("a 4 KiB read at %d (qemu-img map: %s) allocates %.1f times", off,
				map[bool]string{true: "uncompressed", false: "compressed"}[off == plain], a)
		}
	}
}
