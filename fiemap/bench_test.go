package fiemap

import (
	"io"
	"math/rand/v2"
	"os"
	"testing"
)

// benchExtents is the number of data extents of the benchmark file: 4 KiB
// of data every 8 KiB, synced so they are real extents.
const benchExtents = 4096

func benchFile(b *testing.B) *os.File {
	return makeFile(b, b.TempDir(), "frag", steps(fragment(benchExtents, 4096, 8192), fsync))
}

// warmMap returns a Map of f that has walked it once.
func warmMap(b *testing.B, f *os.File, method Method) *Map {
	m := newMap(b, f, nil, method)
	walk(b, m)
	return m
}

func randomOffsets(size int64) []int64 {
	rng := rand.New(rand.NewPCG(1, 1))
	offs := make([]int64, 1024)
	for i := range offs {
		offs[i] = rng.Int64N(size)
	}
	return offs
}

// BenchmarkNextData is one query on a warm cache, at random offsets.
func BenchmarkNextData(b *testing.B) {
	f := benchFile(b)
	m := warmMap(b, f, MethodUnknown)
	offs := randomOffsets(m.Size())
	calls := m.Stats().HostCalls()
	i := 0
	for b.Loop() {
		if _, err := m.NextData(offs[i%len(offs)]); err != nil && err != io.EOF {
			b.Fatal(err)
		}
		i++
	}
	if m.Stats().HostCalls() != calls {
		b.Fatal("cache missed")
	}
}

// BenchmarkNextHole is one query on a warm cache, at random offsets.
func BenchmarkNextHole(b *testing.B) {
	f := benchFile(b)
	m := warmMap(b, f, MethodUnknown)
	offs := randomOffsets(m.Size())
	i := 0
	for b.Loop() {
		if _, err := m.NextHole(offs[i%len(offs)]); err != nil {
			b.Fatal(err)
		}
		i++
	}
}

// BenchmarkData is the per-cluster question, "any data in these 64 KiB?".
func BenchmarkData(b *testing.B) {
	f := benchFile(b)
	m := warmMap(b, f, MethodUnknown)
	offs := randomOffsets(m.Size())
	i := 0
	for b.Loop() {
		if _, err := m.Data(offs[i%len(offs)], 64<<10); err != nil {
			b.Fatal(err)
		}
		i++
	}
}

// BenchmarkNextDataParallel is the hit path from every core at once.
func BenchmarkNextDataParallel(b *testing.B) {
	f := benchFile(b)
	m := warmMap(b, f, MethodUnknown)
	offs := randomOffsets(m.Size())
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			if _, err := m.NextData(offs[i%len(offs)]); err != nil && err != io.EOF {
				b.Error(err)
				return
			}
			i++
		}
	})
}

// BenchmarkWalk is a full forward walk (NextData, NextHole, ...) of a file
// of benchExtents extents: cold, with each method, warm, and with lseek
// itself for comparison. host-calls/op is per walk.
func BenchmarkWalk(b *testing.B) {
	f := benchFile(b)
	for _, bb := range []struct {
		name   string
		method Method
		warm   bool
	}{
		{"cold fiemap", MethodUnknown, false},
		{"cold lseek", MethodLseek, false},
		{"warm", MethodUnknown, true},
	} {
		b.Run(bb.name, func(b *testing.B) {
			var calls int64
			var m *Map
			if bb.warm {
				m = warmMap(b, f, bb.method)
			}
			for b.Loop() {
				if !bb.warm {
					var err error
					if m, err = New(f, nil); err != nil {
						b.Fatal(err)
					}
					m.method.Store(int32(bb.method))
				}
				before := m.Stats().HostCalls()
				if n := len(walk(b, m)); n != benchExtents {
					b.Fatalf("%d extents", n)
				}
				calls += m.Stats().HostCalls() - before
				if !bb.warm {
					m.Close()
				}
			}
			b.ReportMetric(float64(calls)/float64(b.N), "host-calls/op")
		})
	}
	b.Run("kernel lseek", func(b *testing.B) {
		k := newKernel(b, f)
		for b.Loop() {
			if n := len(k.walk(b)); n != benchExtents {
				b.Fatalf("%d extents", n)
			}
		}
		b.ReportMetric(2*benchExtents+1, "host-calls/op")
	})
}
