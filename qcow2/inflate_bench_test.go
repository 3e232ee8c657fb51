package qcow2

import (
	"bytes"
	stdflate "compress/flate"
	"io"
	"os"
	"path/filepath"
	"testing"

	kflate "github.com/klauspost/compress/flate"
	"github.com/klauspost/compress/zstd"

	"github.com/qcowfs/qcowfs/test/qemu"
)

// The inflate candidates of issue 5, on 64 KiB clusters of real data (the
// shared libraries and documentation under /usr, as a guest disk holds),
// compressed the way qemu does: raw deflate at zlib's default level, and
// zstd at its default level. The results chose libdeflate (cgo) for
// deflate; see docs/benchmarks.md.
//
//	go test -run XXX -bench Inflate ./qcow2
//
// zstd-qemu decodes frames as qemu-img writes them (the same clusters,
// compressed by qemu-img convert); with -tags noasm, klauspost's decoder
// runs without its assembly.

const benchCluster = 64 << 10

// benchClusters returns up to n clusters of real data from /usr.
func benchClusters(b *testing.B, n int) [][]byte {
	var data []byte
	for _, pattern := range []string{"/usr/lib/x86_64-linux-gnu/*.so*", "/usr/share/doc/*/*", "/usr/bin/*"} {
		files, _ := filepath.Glob(pattern)
		for _, f := range files {
			if len(data) >= n*benchCluster {
				break
			}
			if b, err := os.ReadFile(f); err == nil {
				data = append(data, b...)
			}
		}
	}
	var out [][]byte
	for i := 0; i+benchCluster <= len(data) && len(out) < n; i += benchCluster {
		out = append(out, data[i:i+benchCluster])
	}
	if len(out) == 0 {
		b.Skip("no data under /usr")
	}
	return out
}

func deflateClusters(b *testing.B, clusters [][]byte) [][]byte {
	var out [][]byte
	for _, c := range clusters {
		var buf bytes.Buffer
		w, _ := stdflate.NewWriter(&buf, stdflate.DefaultCompression)
		w.Write(c)
		w.Close()
		out = append(out, buf.Bytes())
	}
	return out
}

func BenchmarkInflate(b *testing.B) {
	clusters := benchClusters(b, 512)
	deflated := deflateClusters(b, clusters)
	dst := make([]byte, benchCluster)
	run := func(name string, frames [][]byte, inflate func(dst, src []byte) error) {
		b.Run(name, func(b *testing.B) {
			b.SetBytes(benchCluster)
			for i := 0; i < b.N; i++ {
				if err := inflate(dst, frames[i%len(frames)]); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	std := stdflate.NewReader(nil)
	run("deflate/compress-flate", deflated, func(dst, src []byte) error {
		std.(stdflate.Resetter).Reset(bytes.NewReader(src), nil)
		_, err := io.ReadFull(std, dst)
		return err
	})
	kl := kflate.NewReader(nil)
	run("deflate/klauspost-flate", deflated, func(dst, src []byte) error {
		kl.(kflate.Resetter).Reset(bytes.NewReader(src), nil)
		_, err := io.ReadFull(kl, dst)
		return err
	})
	if haveLibdeflate {
		r := newRawInflater()
		run("deflate/libdeflate", deflated, r.inflate)
	}
	run("deflate/qcowfs", deflated, newDecompressor(compressionDeflate, benchCluster).decompress)

	enc, _ := zstd.NewWriter(nil)
	var zs [][]byte
	for _, c := range clusters {
		zs = append(zs, enc.EncodeAll(c, nil))
	}
	// klauspost's stream decoder alone, and qcowfs (libzstd for these
	// frames in a cgo build), on frames of klauspost's encoder (zstd) and
	// of libzstd's, as qemu-img writes them (zstd-qemu), which favour
	// libzstd more (see inflate_libzstd.go).
	stream, _ := zstd.NewReader(nil, zstd.WithDecoderConcurrency(1), zstd.WithDecoderLowmem(true))
	klauspost := func(dst, src []byte) error {
		if err := stream.Reset(bytes.NewReader(src)); err != nil {
			return err
		}
		_, err := io.ReadFull(stream, dst)
		return err
	}
	zd := newDecompressor(compressionZstd, benchCluster)
	qframes := qemuZstdFrames(b, clusters)
	for _, set := range []struct {
		name   string
		frames [][]byte
	}{{"zstd", zs}, {"zstd-qemu", qframes}} {
		run(set.name+"/klauspost-stream", set.frames, klauspost)
		run(set.name+"/qcowfs", set.frames, zd.decompress)
	}
}

// qemuZstdFrames compresses clusters with qemu-img convert (zstd) and
// returns the compressed stream of each of its compressed clusters, as
// its L2 entries delimit them.
func qemuZstdFrames(b *testing.B, clusters [][]byte) [][]byte {
	dir := b.TempDir()
	raw, img := filepath.Join(dir, "data.raw"), filepath.Join(dir, "zstd.qcow2")
	if err := os.WriteFile(raw, bytes.Join(clusters, nil), 0o644); err != nil {
		b.Fatal(err)
	}
	qemu.Img(b, "convert", "-q", "-c", "-f", "raw", "-O", "qcow2", "-o", "compression_type=zstd", raw, img)
	file, err := os.ReadFile(img)
	if err != nil {
		b.Fatal(err)
	}
	image, err := Open(img, Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer image.Close()
	var frames [][]byte
	for off := int64(0); off < image.Size(); off += benchCluster {
		e, err := image.top.extent(off, benchCluster, probeNone)
		if err != nil {
			b.Fatal(err)
		}
		if e.Status&StatusCompressed != 0 {
			coff, n := e.layer.compressedRange(e.entry)
			frames = append(frames, file[coff:min(coff+n, int64(len(file)))])
		}
	}
	if len(frames) == 0 {
		b.Fatal("qemu-img compressed no cluster")
	}
	return frames
}
