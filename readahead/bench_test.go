package readahead

import (
	"bytes"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
)

// The benchmarks read a 256 MiB temporary file, written once per process
// (so it is in the page cache) and removed by TestMain.
const benchSize = 256 << 20

var benchFile struct {
	once sync.Once
	dir  string
	err  error
}

func TestMain(m *testing.M) {
	code := m.Run()
	if benchFile.dir != "" {
		os.RemoveAll(benchFile.dir)
	}
	os.Exit(code)
}

// openBenchFile opens the benchmark file, writing it first if needed.
func openBenchFile(b *testing.B) *os.File {
	benchFile.once.Do(func() {
		benchFile.dir, benchFile.err = os.MkdirTemp("", "readahead-bench-")
		if benchFile.err != nil {
			return
		}
		f, err := os.Create(filepath.Join(benchFile.dir, "data"))
		if err != nil {
			benchFile.err = err
			return
		}
		for i := range benchSize / (16 << 20) {
			if _, err := f.Write(randomData(16<<20, uint64(i))); err != nil {
				benchFile.err = err
			}
		}
		if err := f.Close(); benchFile.err == nil {
			benchFile.err = err
		}
	})
	if benchFile.err != nil {
		b.Fatal(benchFile.err)
	}
	f, err := os.Open(filepath.Join(benchFile.dir, "data"))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { f.Close() })
	return f
}

// benchReaders runs bench on the file directly and through a Reader,
// reporting the Reader's underlying reads per call.
func benchReaders(b *testing.B, bench func(b *testing.B, r io.ReaderAt)) {
	b.Run("file", func(b *testing.B) { bench(b, openBenchFile(b)) })
	b.Run("readahead", func(b *testing.B) {
		r := New(openBenchFile(b), Options{})
		defer r.Close()
		bench(b, r)
		st := r.Stats()
		b.ReportMetric(float64(st.Reads)/float64(st.Calls), "reads/call")
		b.ReportMetric(float64(st.ReadBytes)/float64(st.Calls), "B-read/call")
	})
}

// benchClusters are the reads of a sequential scan of a compressed image
// with clusters of 2-38 KiB (about 20 KiB on average), and their mean size.
func benchClusters() ([]span, int64) {
	cs := clustersUpTo(benchSize, 38<<10, 1)
	var sum int64
	for _, c := range cs {
		sum += c.n
	}
	return cs, sum / int64(len(cs))
}

// BenchmarkSequential reads the file as a compressed-image scan does: small
// adjacent reads, each overlapping the previous one by up to 511 bytes.
func BenchmarkSequential(b *testing.B) {
	cs, mean := benchClusters()
	benchReaders(b, func(b *testing.B, r io.ReaderAt) {
		p := make([]byte, 64<<10)
		b.SetBytes(mean)
		for i := 0; b.Loop(); i++ {
			c := cs[i%len(cs)]
			if _, err := r.ReadAt(p[:c.n], c.off); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkSequentialParallel is BenchmarkSequential with GOMAXPROCS
// workers taking consecutive clusters, as parallel inflaters do.
func BenchmarkSequentialParallel(b *testing.B) {
	cs, mean := benchClusters()
	benchReaders(b, func(b *testing.B, r io.ReaderAt) {
		var next atomic.Int64
		b.SetBytes(mean)
		b.RunParallel(func(pb *testing.PB) {
			p := make([]byte, 64<<10)
			for pb.Next() {
				c := cs[(next.Add(1)-1)%int64(len(cs))]
				if _, err := r.ReadAt(p[:c.n], c.off); err != nil {
					b.Error(err)
					return
				}
			}
		})
	})
}

// BenchmarkRandom4K reads 4 KiB blocks at random: the Reader must pass
// them through at no cost.
func BenchmarkRandom4K(b *testing.B) {
	rng := rand.New(rand.NewPCG(1, 1))
	offs := make([]int64, 1<<16)
	for i := range offs {
		offs[i] = rng.Int64N(benchSize/4096) * 4096
	}
	benchReaders(b, func(b *testing.B, r io.ReaderAt) {
		p := make([]byte, 4096)
		b.SetBytes(4096)
		for i := 0; b.Loop(); i++ {
			if _, err := r.ReadAt(p, offs[i%len(offs)]); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkRandom4KMemory is BenchmarkRandom4K over data in memory, where
// an underlying read costs little: what is left is the Reader's own cost
// per call.
func BenchmarkRandom4KMemory(b *testing.B) {
	data := bytes.NewReader(randomData(benchSize, 1))
	rng := rand.New(rand.NewPCG(1, 1))
	offs := make([]int64, 1<<16)
	for i := range offs {
		offs[i] = rng.Int64N(benchSize/4096) * 4096
	}
	bench := func(b *testing.B, r io.ReaderAt) {
		p := make([]byte, 4096)
		b.SetBytes(4096)
		for i := 0; b.Loop(); i++ {
			if _, err := r.ReadAt(p, offs[i%len(offs)]); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.Run("direct", func(b *testing.B) { bench(b, data) })
	b.Run("readahead", func(b *testing.B) {
		r := New(data, Options{})
		defer r.Close()
		bench(b, r)
	})
}
