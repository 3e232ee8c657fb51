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
)

// The inflate candidates of issue 5, on 64 KiB clusters of real data (the
// shared libraries and documentation under /usr, as a guest disk holds),
// compressed the way qemu does: raw deflate at zlib's default level, and
// zstd at its default level. The results chose libdeflate (cgo) for
// deflate; see docs/benchmarks.md.
//
//	go test -run XXX -bench Inflate ./qcow2

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
	run := func(name string, inflate func(dst, src []byte) error) {
		b.Run(name, func(b *testing.B) {
			b.SetBytes(benchCluster)
			for i := 0; i < b.N; i++ {
				if err := inflate(dst, deflated[i%len(deflated)]); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	std := stdflate.NewReader(nil)
	run("deflate/compress-flate", func(dst, src []byte) error {
		std.(stdflate.Resetter).Reset(bytes.NewReader(src), nil)
		_, err := io.ReadFull(std, dst)
		return err
	})
	kl := kflate.NewReader(nil)
	run("deflate/klauspost-flate", func(dst, src []byte) error {
		kl.(kflate.Resetter).Reset(bytes.NewReader(src), nil)
		_, err := io.ReadFull(kl, dst)
		return err
	})
	if haveLibdeflate {
		r := newRawInflater()
		run("deflate/libdeflate", r.inflate)
	}
	run("deflate/qcowfs", newDecompressor(compressionDeflate, benchCluster).decompress)

	enc, _ := zstd.NewWriter(nil)
	var zs [][]byte
	for _, c := range clusters {
		zs = append(zs, enc.EncodeAll(c, nil))
	}
	// klauspost's stream decoder alone, and qcowfs (libzstd for these
	// frames in a cgo build). Frames of libzstd's encoder, as qemu-img
	// writes them, favour libzstd more than these of klauspost's (see
	// inflate_libzstd.go).
	stream, _ := zstd.NewReader(nil, zstd.WithDecoderConcurrency(1), zstd.WithDecoderLowmem(true))
	b.Run("zstd/klauspost-stream", func(b *testing.B) {
		b.SetBytes(benchCluster)
		for i := 0; i < b.N; i++ {
			stream.Reset(bytes.NewReader(zs[i%len(zs)]))
			if _, err := io.ReadFull(stream, dst); err != nil {
				b.Fatal(err)
			}
		}
	})
	zd := newDecompressor(compressionZstd, benchCluster)
	b.Run("zstd/qcowfs", func(b *testing.B) {
		b.SetBytes(benchCluster)
		for i := 0; i < b.N; i++ {
			if err := zd.decompress(dst, zs[i%len(zs)]); err != nil {
				b.Fatal(err)
			}
		}
	})
}
