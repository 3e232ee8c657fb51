package qcow2_test

import (
	"bytes"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestDirectWrites: large aligned data writes go to the host with O_DIRECT
// (qcow2/direct.go), everything else buffered, and the two stay coherent.
// Large writes from aligned and unaligned guest buffers, at aligned and
// unaligned guest offsets (copy-on-write from a backing file at the edges),
// are mixed with small writes into the same clusters and with reads that
// fill the host page cache just before a direct write replaces those bytes.
// After every write the whole disk reads back as a raw model; after Close,
// qemu-img convert equals the model and qemu-img check is clean. The
// writer's counters show which writes went direct.
func TestDirectWrites(t *testing.T) {
	qemu.Require(t, "qemu-img")
	t.Parallel() // (beside the package's other long tests; it has its own folder)
	dir := qemu.TempDir(t)
	const size = 64 << 20
	cases := []struct {
		name string
		make func(path string)
	}{
		{"empty-64k", func(p string) { qemu.Create(t, "qcow2", p, "64M") }},
		{"empty-4k", func(p string) { qemu.Create(t, "qcow2", p, "64M", "-o", "cluster_size=4096") }},
		{"backed", func(p string) {
			base := filepath.Join(dir, "base.qcow2")
			qemu.Create(t, "qcow2", base, "64M")
			qemu.IO(t, base, "write -P 0x5a 0 64M")
			qemu.Create(t, "qcow2", p, "64M", "-b", base, "-F", "qcow2")
		}},
		{"data-file", func(p string) {
			qemu.Create(t, "qcow2", p, "64M", "-o", "data_file="+filepath.Join(dir, "data-file.raw"))
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			path := filepath.Join(dir, c.name+".qcow2")
			c.make(path)
			model, err := os.ReadFile(qemu.ToRaw(t, path, filepath.Join(dir, c.name+".before")))
			if err != nil {
				t.Fatal(err)
			}
			img := openWritable(t, path)
			rng := rand.New(rand.NewPCG(1, uint64(len(c.name))))
			// A buffer whose payload starts 80 bytes in, as a FUSE
			// request's does.
			backing := make([]byte, 4<<20+80)
			got := make([]byte, size)
			var aligned, unaligned int64
			for i := range 40 {
				var off, n int64
				var p []byte
				switch i % 4 {
				case 0: // aligned offset, aligned buffer
					n = int64(1+rng.IntN(4)) << 20
					off = rng.Int64N(size/4096-n/4096) * 4096
					p = make([]byte, n)
					aligned += n
				case 1: // aligned offset, buffer 80 bytes off
					n = int64(256<<10) * int64(1+rng.IntN(12))
					off = rng.Int64N(size/4096-n/4096) * 4096
					p = backing[80 : 80+n]
					aligned += n
				case 2: // unaligned offset and length
					n = int64(300<<10 + rng.IntN(1<<20))
					off = 1 + rng.Int64N(size-n-1)
					p = backing[80 : 80+n]
					unaligned += n
				case 3: // small writes
					n = int64(1 + rng.IntN(8192))
					off = rng.Int64N(size - n)
					p = make([]byte, n)
					unaligned += n
				}
				for j := range p {
					p[j] = byte(rng.Uint32())
				}
				// Read what is about to be replaced: its pages are
				// in the host's cache when the write lands.
				if _, err := img.ReadAt(got[:n], off); err != nil {
					t.Fatal(err)
				}
				if _, err := img.WriteAt(p, off); err != nil {
					t.Fatalf("write %d at %d: %v", n, off, err)
				}
				copy(model[off:], p)
				if _, err := img.ReadAt(got, 0); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got, model) {
					t.Fatalf("after write %d (%d bytes at %d): the disk does not read as the model", i, n, off)
				}
				if i == 20 {
					if err := img.Flush(); err != nil {
						t.Fatal(err)
					}
				}
			}
			st := img.WriteStats()
			if err := img.Close(); err != nil {
				t.Fatal(err)
			}
			// Most of the aligned writes' bytes go direct (all of
			// them but the runs cut at a 4 KiB cluster boundary that
			// an earlier small write left unaligned on the host); the
			// host bytes bound what can.
			if st.DirectBytes < aligned/2 || st.DirectBytes > st.HostBytes {
				t.Errorf("%d bytes written direct, of %d host bytes; the aligned writes were %d bytes", st.DirectBytes, st.HostBytes, aligned)
			}
			after, err := os.ReadFile(qemu.ToRaw(t, path, filepath.Join(dir, c.name+".after")))
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(after, model) {
				t.Errorf("qemu-img convert differs from the model")
			}
			qemuCheck(t, path)
			t.Logf("aligned writes %d bytes, others %d; host bytes %d, of them direct %d", aligned, unaligned, st.HostBytes, st.DirectBytes)
		})
	}
}
