package read

// Bytes through a mount as qemu-img convert makes them: the matrix (both
// read paths, concurrent readers), images changed between opens,
// snapshots, encrypted images.

import (
	"bytes"
	"encoding/json"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestMountMatchesQemu mounts the whole image matrix and checks that every
// exposed raw file has exactly the bytes of qemu-img convert -O raw, read
// sequentially and with many concurrent readers at odd offsets and sizes.
func TestMountMatchesQemu(t *testing.T) {
	src := harness.SourceDir(t)
	images := qemu.Matrix(t, src)
	expect := t.TempDir()
	for _, im := range images {
		qemu.ToRaw(t, im.Path, filepath.Join(expect, im.Name+".raw"))
	}
	// Both ways of answering reads: zero-copy (splice) and copying.
	for _, readPath := range []string{"splice", "copy"} {
		t.Run(readPath, func(t *testing.T) { checkMountMatchesQemu(t, src, expect, images, readPath) })
	}
}

func checkMountMatchesQemu(t *testing.T, src, expect string, images []qemu.Image, readPath string) {
	m := harness.Racy.Mount(t, src, "--read-path="+readPath)
	for _, im := range images {
		t.Run(im.Name, func(t *testing.T) {
			want := filepath.Join(expect, im.Name+".raw")
			got := filepath.Join(m.Dir, im.Name+".raw")

			// Concurrent random reads first, while the page cache is
			// cold, so they reach the daemon in parallel.
			wantBytes, err := os.ReadFile(want)
			if err != nil {
				t.Fatal(err)
			}
			var wg sync.WaitGroup
			for w := 0; w < 8; w++ {
				wg.Add(1)
				go func(seed uint64) {
					defer wg.Done()
					f, err := os.Open(got)
					if err != nil {
						t.Error(err)
						return
					}
					defer f.Close()
					r := rand.New(rand.NewPCG(seed, 2))
					buf := make([]byte, 200000)
					for i := 0; i < 100; i++ {
						off := r.IntN(len(wantBytes))
						n := 1 + r.IntN(min(len(buf), len(wantBytes)-off))
						if i%2 == 0 {
							n = 1 + r.IntN(min(5000, len(wantBytes)-off))
						}
						if k, err := f.ReadAt(buf[:n], int64(off)); k != n || (err != nil && err != io.EOF) {
							t.Errorf("pread(%d, %d) = %d, %v", off, n, k, err)
							return
						}
						if !bytes.Equal(buf[:n], wantBytes[off:off+n]) {
							t.Errorf("pread(%d, %d) differs from qemu-img convert", off, n)
							return
						}
					}
				}(uint64(w))
			}
			wg.Wait()
			harness.SameFile(t, got, want)
		})
	}
}

// readThrough reads the whole file at path (one open) and returns its
// bytes, its size as stat reports it, and its data runs as lseek
// SEEK_DATA/SEEK_HOLE report them.
func readThrough(t *testing.T, path string) ([]byte, int64, [][2]int64) {
	t.Helper()
	f := harness.Open(t, path)
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	runs := harness.SeekRuns(t, f, st.Size())
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b, st.Size(), runs
}

// TestServedFreshAfterChange: an image that qemu changes while none of its
// files is open in the mount (written, snapshotted, resized, compressed
// clusters rewritten, converted over) is served fresh at the next open:
// size, bytes and holes follow the new content, with nothing kept from the
// previous open (the kernel's page cache, L2 tables, decompressed
// clusters, the hole index).
func TestServedFreshAfterChange(t *testing.T) {
	src := harness.SourceDir(t)
	work := t.TempDir()
	plain := filepath.Join(src, "plain.qcow2")
	qemu.Create(t, "qcow2", plain, "8M", "-o", "cluster_size=4096")
	qemu.IO(t, plain, "write -P 0x11 0 1M", "write -P 0x12 4M 64k")
	raw := filepath.Join(work, "patterns.raw")
	qemu.Create(t, "raw", raw, "4M")
	qemu.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x33 0 3M", raw)
	packed := filepath.Join(src, "packed.qcow2")
	qemu.Img(t, "convert", "-q", "-c", "-O", "qcow2", raw, packed)
	other := qemu.Make(t, filepath.Join(work, "other.qcow2"), "6M", "write -P 0x44 1M 2M")

	m := harness.Mount(t, src)
	check := func(what, image, name string) {
		t.Helper()
		want := qemu.RawBytes(t, image)
		got, size, runs := readThrough(t, filepath.Join(m.Dir, name+".raw"))
		if size != int64(len(want)) {
			t.Fatalf("%s: %s.raw is %d bytes, qemu says %d", what, name, size, len(want))
		}
		if i := harness.FirstDiff(got, want); i >= 0 {
			t.Fatalf("%s: %s.raw differs from qemu-img convert at byte %d", what, name, i)
		}
		if wantRuns := qemu.DataRuns(t, image); !slices.Equal(runs, wantRuns) {
			t.Fatalf("%s: %s.raw data runs %v, qemu-img map %v", what, name, runs, wantRuns)
		}
	}
	check("first open", plain, "plain")
	check("first open", packed, "packed")

	// Written where the page cache and the hole index have seen zeros
	// and data, and past the old end after a resize.
	qemu.IO(t, plain, "write -P 0x21 512k 8k", "write -z 4M 64k", "write -P 0x22 6M 4k")
	check("after qemu-io writes", plain, "plain")
	qemu.Img(t, "resize", "-q", plain, "12M")
	qemu.IO(t, plain, "write -P 0x23 10M 4k")
	check("after qemu-img resize", plain, "plain")
	qemu.Img(t, "snapshot", "-c", "later", plain)
	qemu.IO(t, plain, "write -P 0x24 0 4k")
	check("after a snapshot and a write", plain, "plain")
	if _, err := os.Stat(filepath.Join(m.Dir, "plain@later.raw")); err != nil {
		t.Errorf("the new snapshot is not shown: %v", err)
	}

	// Compressed clusters rewritten: the decompressed-cluster cache must
	// not answer for them.
	qemu.IO(t, packed, "discard 0 64k", "write -c -P 0x55 0 64k", "write -P 0x56 100k 3000")
	check("after compressed writes", packed, "packed")

	// Converted over: the same file name, other content.
	qemu.Img(t, "convert", "-O", "qcow2", other, plain)
	check("after qemu-img convert over it", plain, "plain")
}

// TestSnapshotFiles: each internal snapshot appears next to its image as
// STEM@NAME.raw (escaped), with the snapshot's own virtual size and
// bytes; the oracle is a copy of the image reverted to the snapshot with
// qemu-img snapshot -a.
func TestSnapshotFiles(t *testing.T) {
	src := harness.SourceDir(t)
	vm := qemu.Make(t, filepath.Join(src, "vm.qcow2"), "8M", "write -P 0x81 0 1M", "write -P 0x82 5M 64k")
	qemu.Img(t, "snapshot", "-c", "first", vm)
	qemu.IO(t, vm, "write -P 0x83 512k 1M", "write -z 5M 4k")
	qemu.Img(t, "resize", "-q", vm, "12M")
	qemu.Img(t, "snapshot", "-c", "two/with slash", vm)
	qemu.IO(t, vm, "write -P 0x84 10M 100k")
	m := harness.Mount(t, src)

	want := []string{"vm.raw", "vm@first.raw", "vm@two%2Fwith slash.raw"}
	if got := harness.Names(t, m.Dir); !slices.Equal(got, want) {
		t.Fatalf("lists %q, want %q", got, want)
	}
	tmp := t.TempDir()
	for id, file := range map[string]string{"1": "vm@first.raw", "2": "vm@two%2Fwith slash.raw"} {
		cp := filepath.Join(tmp, id+".qcow2")
		qemu.Run(t, "cp", vm, cp)
		qemu.Img(t, "snapshot", "-a", id, cp)
		raw := qemu.ToRaw(t, cp, filepath.Join(tmp, id+".raw"))
		harness.SameFile(t, filepath.Join(m.Dir, file), raw)
	}
	harness.SameFile(t, filepath.Join(m.Dir, "vm.raw"), qemu.ToRaw(t, vm, filepath.Join(tmp, "vm.raw")))
	st, err := os.Stat(filepath.Join(m.Dir, "vm@first.raw"))
	if err != nil {
		t.Fatal(err)
	}
	if st.Size() != 8<<20 {
		t.Errorf("vm@first.raw is %d bytes; the snapshot was taken at 8 MiB", st.Size())
	}
}

// TestEncryptedThroughMount mounts the encrypted matrix (every cipher,
// mode, IV generator and hash qemu 7.2 makes that qcowfs reads; 512 B,
// 64 KiB and 2 MiB clusters; extended L2; a chain of two encrypted images
// with different passphrases; an encrypted image over a plain one;
// legacy AES), each image with its own passphrase in --key-dir but one,
// whose passphrase is the --key-file. For each: cmp of the raw file and
// qemu-img convert with the secrets; the lseek walk against qemu-img map
// with the secrets; qcowfs info --output=json with the key against
// qemu-img info, byte for byte, and its encrypt block against qemu-img
// info's with the secrets.
func TestEncryptedThroughMount(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "qemu-img", "qemu-io", "cmp")
	src := qemu.TempDir(t)
	images := qemu.EncryptedMatrix(t, src, qemu.LUKSSpecs())
	keys := qemu.KeyDir(t, src, images)
	// luks-c512's passphrase comes from --key-file: none in --key-dir.
	os.Remove(filepath.Join(keys, "luks-c512.qcow2"))
	keyFile := filepath.Join(t.TempDir(), "key")
	os.WriteFile(keyFile, []byte("pass-luks-c512"), 0o600)

	m := harness.Racy.Mount(t, src, "--key-dir", keys, "--key-file", keyFile)
	if strings.Contains(m.Said, "not shown") {
		t.Fatalf("qcowfs mount refused images:\n%s", m.Said)
	}
	out := t.TempDir()
	for _, e := range images {
		t.Run(e.Name, func(t *testing.T) {
			p := filepath.Join(m.Dir, e.Name+".raw")
			runs := harness.FileRuns(t, p)
			raw := e.ToRaw(t, filepath.Join(out, e.Name+".raw"))
			defer os.Remove(raw)
			e.CheckHoles(t, runs, raw)
			harness.WantOK(t, "cmp", harness.Exec(t, "cmp", p, raw))

			// info, with the key (the image opened), as qemu-img
			// info prints it; and its encrypt block as qemu's with
			// the secrets.
			r := harness.Run(t, "info", "--output=json", "--key-dir", keys, "--key-file", keyFile, e.Path)
			harness.WantOK(t, "qcowfs info", r)
			if r.Stderr != "" {
				t.Errorf("qcowfs info says %q", r.Stderr)
			}
			if q := string(qemu.Img(t, "info", "--output=json", e.Path)); r.Stdout != q {
				t.Errorf("qcowfs info:\n%s\nqemu-img info:\n%s", r.Stdout, q)
			}
			var us, them struct {
				FormatSpecific struct {
					Data struct {
						Encrypt map[string]any `json:"encrypt"`
					} `json:"data"`
				} `json:"format-specific"`
				Encrypted bool `json:"encrypted"`
			}
			r.JSON(t, &us)
			top := e // (qemu-img info opens no backing file)
			top.Chain = e.Chain[:1]
			if err := json.Unmarshal(qemu.Img(t, append(top.Args(t, "info"), "--output=json")...), &them); err != nil {
				t.Fatal(err)
			}
			if !us.Encrypted || us.FormatSpecific.Data.Encrypt == nil || !reflect.DeepEqual(us, them) {
				t.Errorf("encrypt block: qcowfs %+v, qemu-img with the secrets %+v", us, them)
			}
		})
	}
	m.NoPanics(t)
}
