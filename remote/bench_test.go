package remote

import (
	"fmt"
	"io"
	"net/http"
	"testing"
)

// BenchmarkCacheHit measures a 4 KiB ReadAt served from the memory cache:
// the path every FUSE read of a warm image takes.
func BenchmarkCacheHit(b *testing.B) {
	const size = 4 << 20
	ng, _ := nginxWith(b, size, false)
	opts := testOptions(nil)
	opts.ChunkSize = 256 << 10
	opts.MaxRequest = 4 << 20
	opts.CacheSize = 2 * size
	o := open(b, newClient(b, opts), ng.URL+"/disk.img")
	readAll(b, o, 1<<20)
	warm := o.Stats().Misses
	p := make([]byte, 4096)
	b.SetBytes(4096)
	b.ReportAllocs()
	off := int64(0)
	for b.Loop() {
		if _, err := o.ReadAt(p, off); err != nil {
			b.Fatal(err)
		}
		off = (off + 4096*7) % (size - 4096)
	}
	if st := o.Stats(); st.Misses != warm {
		b.Fatalf("%d misses in a warm cache", st.Misses-warm)
	}
}

// BenchmarkCacheHitParallel is BenchmarkCacheHit with a reader per core.
func BenchmarkCacheHitParallel(b *testing.B) {
	const size = 4 << 20
	ng, _ := nginxWith(b, size, false)
	opts := testOptions(nil)
	opts.ChunkSize = 256 << 10
	opts.CacheSize = 2 * size
	o := open(b, newClient(b, opts), ng.URL+"/disk.img")
	readAll(b, o, 1<<20)
	b.SetBytes(4096)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		p := make([]byte, 4096)
		off := int64(0)
		for pb.Next() {
			if _, err := o.ReadAt(p, off); err != nil {
				b.Error(err)
				return
			}
			off = (off + 4096*13) % (size - 4096)
		}
	})
}

// BenchmarkSequential reads a 64 MiB file through nginx on loopback from
// a cold cache, in 128 KiB reads (what FUSE sends), for several chunk
// sizes; "whole-GET" is one plain GET of the file, the naive baseline.
func BenchmarkSequential(b *testing.B) {
	const size = 64 << 20
	ng, _ := nginxWith(b, size, false)
	b.Run("whole-GET", func(b *testing.B) {
		b.SetBytes(size)
		for b.Loop() {
			resp, err := http.Get(ng.URL + "/disk.img")
			if err != nil {
				b.Fatal(err)
			}
			if n, err := io.Copy(io.Discard, resp.Body); err != nil || n != size {
				b.Fatal(n, err)
			}
			resp.Body.Close()
		}
	})
	for _, cs := range []int64{64 << 10, 256 << 10, 1 << 20, 4 << 20} {
		b.Run(fmt.Sprintf("chunk-%dK", cs>>10), func(b *testing.B) {
			opts := Options{ChunkSize: cs, CacheSize: 64 << 20}
			c := newClient(b, opts)
			p := make([]byte, 128<<10)
			b.SetBytes(size)
			var requests int64
			for b.Loop() {
				o, err := c.Open(b.Context(), ng.URL+"/disk.img")
				if err != nil {
					b.Fatal(err)
				}
				for off := int64(0); off < size; off += int64(len(p)) {
					if _, err := o.ReadAt(p, off); err != nil {
						b.Fatal(err)
					}
				}
				requests += o.Stats().Requests
				o.Close() // frees its chunks: the next round starts cold
			}
			b.ReportMetric(float64(requests)/float64(b.N), "requests/op")
		})
	}
}
