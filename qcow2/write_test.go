package qcow2_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"

	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/test/qemu"
)

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

func sha(t *testing.T, path string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}

// openWritable opens an image of the write matrix for writing.
func openWritable(t *testing.T, path string) *qcow2.Image {
	t.Helper()
	f, err := qcow2.OpenWritableFile(path)
	if err != nil {
		t.Fatal(err)
	}
	img, err := qcow2.NewImage(f, qcow2.Options{Writable: true, Cache: qcow2.NewCache(1<<20, 1<<20)})
	if err != nil {
		t.Fatal(err)
	}
	if !img.Writable() {
		t.Fatalf("%s opened read-only: %s", path, img.ReadOnlyReason())
	}
	return img
}

// apply applies op to img, failing the test on an error.
func apply(t *testing.T, img *qcow2.Image, op qemu.Op) {
	t.Helper()
	if err := applyOp(img, op); err != nil {
		t.Fatalf("%v: %v", op, err)
	}
}

// applyOp applies op to img.
func applyOp(img *qcow2.Image, op qemu.Op) error {
	var err error
	switch op.Kind {
	case qemu.OpWrite:
		_, err = img.WriteAt(op.Data(), op.Off)
	case qemu.OpDiscard:
		err = img.Discard(op.Off, op.Len)
	case qemu.OpZero:
		err = img.WriteZeroes(op.Off, op.Len)
	case qemu.OpResize:
		err = img.Resize(op.Off)
	case qemu.OpFlush:
		err = img.Flush()
	}
	return err
}

// qemuCheck runs qemu-img check and fails the test on any error, leak or
// corruption it reports.
func qemuCheck(t *testing.T, path string) {
	t.Helper()
	out, err := exec.Command("qemu-img", "check", "--output=json", path).Output()
	var res struct {
		CheckErrors int `json:"check-errors"`
		Corruptions int `json:"corruptions"`
		Leaks       int `json:"leaks"`
	}
	if jerr := json.Unmarshal(out, &res); jerr != nil {
		t.Fatalf("qemu-img check %s: %v, %v: %s", path, err, jerr, out)
	}
	if err != nil || res.CheckErrors+res.Corruptions+res.Leaks != 0 {
		human, _ := exec.Command("qemu-img", "check", path).CombinedOutput()
		t.Fatalf("qemu-img check %s: %d errors, %d corruptions, %d leaks (%v):\n%s", path, res.CheckErrors, res.Corruptions, res.Leaks, err, human)
	}
}

// TestWriteMatchesModel applies a seeded sequence of writes, discards,
// zeroings, flushes and a resize to every image of the write matrix
// through the library, and the same to a raw model of the disk. After
// Close: qemu-img check finds no errors and no leaks, qemu-img convert
// equals the model, every snapshot and every backing file is unchanged,
// and qemu-img map shows clusters last discarded or zeroed whole as zero.
func TestWriteMatchesModel(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	t.Parallel() // (beside the package's other long tests; it has its own folder)
	dir := qemu.TempDir(t)
	for _, im := range qemu.WriteMatrix(t, dir) {
		t.Run(im.Name, func(t *testing.T) {
			keep := map[string][32]byte{}
			for _, k := range im.Keep {
				keep[k] = sha(t, k)
			}
			snaps := map[string][]byte{}
			for _, s := range im.Snapshots {
				p := filepath.Join(dir, im.Name+"@"+s+".raw")
				qemu.Img(t, "convert", "-l", "snapshot.name="+s, "-O", "raw", im.Path, p)
				b, _ := os.ReadFile(p)
				snaps[s] = b
			}
			model, err := os.ReadFile(qemu.ToRaw(t, im.Path, filepath.Join(dir, im.Name+".before")))
			if err != nil {
				t.Fatal(err)
			}
			h := fnv.New64a()
			h.Write([]byte(im.Name))
			ops := qemu.Ops(h.Sum64(), 60, int64(len(model)), im.ClusterSize)

			img := openWritable(t, im.Path)
			// zeroed[c] is set when cluster c was last discarded or
			// zeroed whole.
			zeroed := map[int64]bool{}
			buf := make([]byte, 1<<20)
			for i, op := range ops {
				apply(t, img, op)
				model = op.Apply(model)
				switch op.Kind {
				case qemu.OpWrite:
					for c := op.Off / im.ClusterSize; c <= (op.Off+op.Len-1)/im.ClusterSize; c++ {
						delete(zeroed, c)
					}
				case qemu.OpDiscard, qemu.OpZero:
					for c := (op.Off + im.ClusterSize - 1) / im.ClusterSize; (c+1)*im.ClusterSize <= op.Off+op.Len; c++ {
						zeroed[c] = true
					}
				}
				if img.Size() != int64(len(model)) {
					t.Fatalf("after %v the disk is %d bytes, want %d", op, img.Size(), len(model))
				}
				// Read back around what changed, through the library.
				if op.Kind != qemu.OpFlush && op.Kind != qemu.OpResize && i%3 == 0 {
					start := max(0, op.Off-4096)
					n := min(int64(len(buf)), int64(len(model))-start)
					if _, err := img.ReadAt(buf[:n], start); err != nil {
						t.Fatalf("read after %v: %v", op, err)
					}
					if !bytes.Equal(buf[:n], model[start:start+n]) {
						t.Fatalf("after %v, the library reads [%d, +%d) differently from the model", op, start, n)
					}
				}
			}
			if err := img.Close(); err != nil {
				t.Fatalf("Close: %v", err)
			}
			qemuCheck(t, im.Path)
			got, err := os.ReadFile(qemu.ToRaw(t, im.Path, filepath.Join(dir, im.Name+".after")))
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != len(model) {
				t.Fatalf("qemu-img convert makes %d bytes, the model has %d", len(got), len(model))
			}
			if i := firstDiff(got, model); i >= 0 {
				t.Fatalf("qemu-img convert differs from the model at byte %d: %#x != %#x", i, got[i], model[i])
			}
			for k, want := range keep {
				if sha(t, k) != want {
					t.Errorf("backing file %s changed", k)
				}
			}
			for s, want := range snaps {
				p := filepath.Join(dir, im.Name+"@"+s+".after")
				qemu.Img(t, "convert", "-l", "snapshot.name="+s, "-O", "raw", im.Path, p)
				// (qemu-img convert -l makes the image's current size:
				// past the snapshot's own, zeros.)
				b, _ := os.ReadFile(p)
				if len(b) < len(want) || !bytes.Equal(b[:len(want)], want) || !allZero(b[len(want):]) {
					t.Errorf("snapshot %s reads differently after the writes", s)
				}
			}
			if im.V2 && im.Backed {
				return // zeros over a backing file are written data there
			}
			for _, e := range qemu.Map(t, im.Path) {
				for c := e.Start / im.ClusterSize; c < (e.Start+e.Length)/im.ClusterSize; c++ {
					if zeroed[c] && (e.Data || !e.Zero) {
						t.Errorf("cluster %d was discarded or zeroed last, qemu-img map says %+v", c, e)
						break
					}
				}
			}
		})
	}
}

// TestConcurrentWriters: writers on one image, each with its own byte
// range, the ranges not cluster aligned so that neighbours race for the
// clusters they share (qemu tracks such in-flight allocations; so must
// we), with readers and flushes going on, and writers on several images
// at once. Each range must hold exactly what its writer wrote; qemu-img
// check must find the images clean, and qemu-img convert must equal the
// model. (Run under -race by make test.)
func TestConcurrentWriters(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	dir := qemu.TempDir(t)
	var paths []string
	for i, opts := range []string{"cluster_size=65536", "cluster_size=4096,extended_l2=off", "cluster_size=65536,extended_l2=on"} {
		p := filepath.Join(dir, fmt.Sprintf("c%d.qcow2", i))
		qemu.Create(t, "qcow2", p, "64M", "-o", opts)
		qemu.IO(t, p, "write -P 0x11 0 8M")
		paths = append(paths, p)
	}
	const writers, region = 4, 5<<20 + 12345
	var wg sync.WaitGroup
	models := make([][]byte, len(paths))
	imgs := make([]*qcow2.Image, len(paths))
	for k, p := range paths {
		model, err := os.ReadFile(qemu.ToRaw(t, p, p+".before"))
		if err != nil {
			t.Fatal(err)
		}
		models[k] = model
		imgs[k] = openWritable(t, p)
		for w := 0; w < writers; w++ {
			wg.Add(1)
			go func(img *qcow2.Image, model []byte, w int) {
				defer wg.Done()
				r := rand.New(rand.NewPCG(uint64(w), uint64(k)))
				lo := int64(w*region + 1000)
				hi := lo + region
				for i := 0; i < 150; i++ {
					off := lo + r.Int64N(region-1)
					n := min(1+r.Int64N(300<<10), hi-off)
					switch r.IntN(6) {
					case 0:
						if err := img.Discard(off, n); err != nil {
							t.Error(err)
							return
						}
						clear(model[off : off+n])
					case 1:
						if err := img.Flush(); err != nil {
							t.Error(err)
							return
						}
					case 2:
						got := make([]byte, n)
						if _, err := img.ReadAt(got, off); err != nil {
							t.Error(err)
							return
						}
						if !bytes.Equal(got, model[off:off+n]) {
							t.Errorf("writer %d reads its range [%d, +%d) differently from what it wrote", w, off, n)
							return
						}
					default:
						b := make([]byte, n)
						for j := range b {
							b[j] = byte(w*50 + i + j%7)
						}
						if _, err := img.WriteAt(b, off); err != nil {
							t.Error(err)
							return
						}
						copy(model[off:], b)
					}
				}
			}(imgs[k], models[k], w)
		}
	}
	wg.Wait()
	for k, p := range paths {
		if err := imgs[k].Close(); err != nil {
			t.Fatal(err)
		}
		qemuCheck(t, p)
		got, err := os.ReadFile(qemu.ToRaw(t, p, p+".after"))
		if err != nil {
			t.Fatal(err)
		}
		if i := firstDiff(got, models[k]); i >= 0 {
			t.Fatalf("%s: qemu-img convert differs from the writers' model at byte %d", p, i)
		}
	}
}
