package qcow2_test

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// The model-based random test of the write path: random sequences of
// writes, zero-writes, discards, grows, flushes and remounts (close and
// open again) on small images that qemu made to sit just before the
// points where tables must grow, applied to the image through the library
// and to a raw model file with plain file operations. After every step the
// image reads like the model around the step; after every sequence
// qemu-img check finds neither corruption nor leak, and qemu-img compare
// finds the image equal to the model. FuzzWrite is the same over programs
// the fuzzer makes.

// A modelTemplate is an image to start sequences from.
type modelTemplate struct {
	name string
	// make builds it in dir (as name.qcow2, with any backing or data
	// files beside it).
	make func(t testing.TB, dir, p string)
	// maxSize bounds what grows may make of the disk (its L1 table
	// and the model file stay small).
	maxSize int64
}

func modelTemplates() []modelTemplate {
	img := func(size string, opts ...string) func(testing.TB, string, string) {
		return func(t testing.TB, dir, p string) {
			qemu.Create(t, "qcow2", p, size, opts...)
		}
	}
	then := func(mk func(testing.TB, string, string), cmds ...string) func(testing.TB, string, string) {
		return func(t testing.TB, dir, p string) {
			mk(t, dir, p)
			if len(cmds) > 0 {
				qemu.IO(t, p, cmds...)
			}
		}
	}
	snapshot := func(mk func(testing.TB, string, string), after ...string) func(testing.TB, string, string) {
		return func(t testing.TB, dir, p string) {
			mk(t, dir, p)
			qemu.Img(t, "snapshot", "-c", "s1", p)
			if len(after) > 0 {
				qemu.IO(t, p, after...)
			}
		}
	}
	backed := func(opts ...string) func(testing.TB, string, string) {
		return func(t testing.TB, dir, p string) {
			base := strings.TrimSuffix(p, ".qcow2") + "-base.qcow2"
			qemu.Create(t, "qcow2", base, "1M", "-o", "cluster_size=16384")
			qemu.IO(t, base, "write -P 0x7 0 1M")
			qemu.Create(t, "qcow2", p, "1536K", append([]string{"-b", filepath.Base(base), "-F", "qcow2"}, opts...)...)
		}
	}
	return []modelTemplate{
		// 512 B clusters, 16-bit refcounts: one refcount table cluster
		// covers 8 MiB of file; 7.8 MiB are in use, so the next
		// allocations (an L1 table of a grow among them) grow it.
		{"reftable-c512", then(img("64M", "-o", "cluster_size=512"), "write -P 0x3 0 7800k"), 1 << 30},
		// 64-bit refcounts: a refcount table cluster covers 2 MiB.
		{"reftable-c512-r64", then(img("4M", "-o", "cluster_size=512,refcount_bits=64"), "write -P 0x4 0 1900k"), 256 << 20},
		// 1-bit refcounts: a block covers 2 MiB, the table 128 MiB.
		{"c512-r1", then(img("3M", "-o", "cluster_size=512,refcount_bits=1"), "write -P 0x5 100k 900k"), 256 << 20},
		{"c512-r2", img("1M", "-o", "cluster_size=512,refcount_bits=2"), 64 << 20},
		{"c4k-r8", then(img("1M", "-o", "cluster_size=4096,refcount_bits=8"), "write -P 0x6 4k 600k"), 2 << 30},
		{"c4k-r32", img("512K", "-o", "cluster_size=4096,refcount_bits=32"), 2 << 30},
		// An L1 table of one entry: a grow past 2 MiB moves it.
		{"l1-c4k-r64", then(img("1M", "-o", "cluster_size=4096,refcount_bits=64"), "write -P 0x8 0 1M"), 4 << 30},
		{"l1-c64k", then(img("32M", "-o", "cluster_size=65536"), "write -P 0x9 1M 3M"), 64 << 30},
		{"v2-c4k", then(img("2M", "-o", "compat=0.10,cluster_size=4096"), "write -P 0xa 0 1M"), 1 << 30},
		// Internal snapshots: shared clusters and L2 tables.
		{"snapshot-c512-r4", snapshot(then(img("1M", "-o", "cluster_size=512,refcount_bits=4"), "write -P 0xb 0 700k"), "write -P 0xc 64k 64k"), 64 << 20},
		{"snapshot-c4k", snapshot(then(img("2M", "-o", "cluster_size=4096"), "write -P 0xd 0 2M")), 1 << 30},
		{"backing-c4k", backed("-o", "cluster_size=4096"), 1 << 30},
		{"backing-v2-c512", backed("-o", "compat=0.10,cluster_size=512"), 64 << 20},
		{"extl2-c16k", backed("-o", "extended_l2=on,cluster_size=16384"), 1 << 30},
		{"compressed", func(t testing.TB, dir, p string) {
			raw := p + ".src"
			qemu.Create(t, "raw", raw, "2M")
			qemu.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x9 0 2M", raw)
			qemu.Img(t, "convert", "-q", "-c", "-O", "qcow2", raw, p)
		}, 1 << 30},
		{"datafile", func(t testing.TB, dir, p string) {
			qemu.Create(t, "qcow2", p, "1M", "-o", "data_file="+filepath.Join(dir, "image.data"))
		}, 64 << 20},
	}
}

// modelOp is one step of a program.
type modelOp struct {
	qemu.Op
	remount bool
}

func (o modelOp) String() string {
	if o.remount {
		return fmt.Sprintf("%d:remount", o.N)
	}
	return o.Op.String()
}

// opBytes is the size of one encoded step.
const opBytes = 6

// decodeOp turns 6 bytes into a step on a disk of size bytes with
// clusters of cs bytes, at most maxSize after a grow. Offsets and lengths
// are biased towards cluster and table boundaries and the end of the disk,
// where the write path has its special cases.
func decodeOp(b []byte, n int, size, cs, maxSize int64) modelOp {
	op := modelOp{Op: qemu.Op{N: n}}
	u := int64(binary.BigEndian.Uint16(b[1:]))
	v := int64(binary.BigEndian.Uint16(b[3:]))
	mode := b[5]
	switch b[0] % 16 {
	case 0, 1, 2, 3, 4, 5:
		op.Kind = qemu.OpWrite
	case 6, 7:
		op.Kind = qemu.OpZero
	case 8, 9:
		op.Kind = qemu.OpDiscard
	case 10, 11:
		op.Kind = qemu.OpResize
	case 12, 13:
		op.Kind = qemu.OpFlush
		return op
	default:
		op.remount = true
		return op
	}
	if op.Kind == qemu.OpResize {
		var grow int64
		switch mode % 4 {
		case 0:
			grow = (v%64 + 1) * 512
		case 1:
			grow = (v%16 + 1) * cs
		case 2:
			grow = size
		default:
			grow = maxSize - size // as far as allowed, in one step
		}
		op.Off = min(size+grow, maxSize) / 512 * 512
		if op.Off <= size {
			op.Kind = qemu.OpFlush
		}
		return op
	}
	switch mode % 4 {
	case 0: // anywhere
		op.Off = u * size / 65536
	case 1: // at or around a cluster boundary
		op.Off = (u*size/65536)/cs*cs + int64(int8(mode))
	case 2: // near the end
		op.Off = size - 1 - u%(4*cs)
	default: // in the first clusters (and tables)
		op.Off = u % (8 * cs)
	}
	op.Off = min(max(op.Off, 0), size-1)
	switch mode / 4 % 4 {
	case 0:
		op.Len = 1 + v%1024
	case 1:
		op.Len = cs * (1 + v%4)
	case 2:
		op.Len = 1 + v*16 // up to 1 MiB
	default:
		op.Len = 1 + v%(3*cs)
	}
	op.Len = min(op.Len, size-op.Off)
	return op
}

// modelRun is one program applied to an image and its model.
type modelRun struct {
	t        testing.TB
	tpl      modelTemplate
	path     string
	model    *os.File
	img      *qcow2.Image
	cs       int64
	verbose  []string // the steps so far, for the failure message
	byQemu   bool     // check with qemu-img (else with the library's Check)
	snapshot string   // a raw copy of the snapshot, when the image has one
}

func (r *modelRun) open() {
	f, err := qcow2.OpenWritableFile(r.path)
	if err != nil {
		r.t.Fatal(err)
	}
	img, err := qcow2.NewImage(f, qcow2.Options{Writable: true, Cache: qcow2.NewCache(256<<10, 256<<10)})
	if err != nil {
		r.t.Fatalf("%s: open: %v (after %s)", r.tpl.name, err, r.steps())
	}
	if !img.Writable() {
		r.t.Fatalf("%s opened read-only: %s (after %s)", r.tpl.name, img.ReadOnlyReason(), r.steps())
	}
	r.img = img
}

func (r *modelRun) steps() string { return strings.Join(r.verbose, " ") }

func (r *modelRun) fatalf(format string, args ...any) {
	r.t.Helper()
	r.t.Fatalf("%s: %s\nsteps: %s", r.tpl.name, fmt.Sprintf(format, args...), r.steps())
}

// apply applies op to the image and to the model file.
func (r *modelRun) apply(op modelOp) {
	r.verbose = append(r.verbose, op.String())
	if op.remount {
		if err := r.img.Close(); err != nil {
			r.fatalf("close: %v", err)
		}
		r.open()
		return
	}
	var err, merr error
	switch op.Kind {
	case qemu.OpWrite:
		data := op.Data()
		_, err = r.img.WriteAt(data, op.Off)
		_, merr = r.model.WriteAt(data, op.Off)
	case qemu.OpDiscard, qemu.OpZero:
		if op.Kind == qemu.OpDiscard {
			err = r.img.Discard(op.Off, op.Len)
		} else {
			err = r.img.WriteZeroes(op.Off, op.Len)
		}
		merr = unix.Fallocate(int(r.model.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, op.Off, op.Len)
	case qemu.OpResize:
		err = r.img.Resize(op.Off)
		merr = r.model.Truncate(op.Off)
	case qemu.OpFlush:
		err = r.img.Flush()
	}
	if err != nil || merr != nil {
		r.fatalf("%v: %v (model: %v)", op, err, merr)
	}
	r.compareAround(op)
}

// compareAround compares the image with the model around what op touched.
func (r *modelRun) compareAround(op modelOp) {
	size := r.img.Size()
	at, end := max(0, op.Off-2048), min(size, op.Off+op.Len+2048)
	if op.Kind == qemu.OpResize || op.Kind == qemu.OpFlush {
		at, end = max(0, size-8192), size
	}
	got, want := make([]byte, end-at), make([]byte, end-at)
	if _, err := r.img.ReadAt(got, at); err != nil {
		r.fatalf("read [%d, %d): %v", at, end, err)
	}
	if _, err := r.model.ReadAt(want, at); err != nil {
		r.fatalf("model read [%d, %d): %v", at, end, err)
	}
	if i := firstDiff(got, want); i >= 0 {
		r.fatalf("after %v the image reads %#x at %d, the model %#x", op, got[i], at+int64(i), want[i])
	}
}

// finish closes the image and checks it: no corruption, no leak, the
// model's bytes, and the snapshot unchanged.
func (r *modelRun) finish() {
	if err := r.img.Close(); err != nil {
		r.fatalf("close: %v", err)
	}
	if !r.byQemu {
		c, err := qcow2.Open(r.path, qcow2.Options{NoBacking: true, LenientTables: true})
		if err != nil {
			r.fatalf("open for check: %v", err)
		}
		res, err := c.Check(context.Background(), nil)
		c.Close()
		if err != nil || res.Corruptions+res.Leaks+res.CheckErrors > 0 {
			r.fatalf("check: %v %+v %v", err, res, res.Messages)
		}
		return
	}
	if out, err := exec.Command("qemu-img", "check", r.path).CombinedOutput(); err != nil {
		r.fatalf("qemu-img check: %v\n%s", err, firstLines(out, 20))
	}
	if out, err := exec.Command("qemu-img", "compare", "-f", "qcow2", "-F", "raw", r.path, r.model.Name()).CombinedOutput(); err != nil {
		r.fatalf("qemu-img compare with the model: %v\n%s", err, out)
	}
	if r.snapshot != "" {
		// (qemu-img convert -l reads a snapshot at the disk's size now,
		// zeros past the snapshot's own; compare sees them as equal.)
		raw := filepath.Join(r.t.TempDir(), "snapshot.raw")
		qemu.Img(r.t, "convert", "-l", "snapshot.name=s1", "-O", "raw", r.path, raw)
		if out, err := exec.Command("qemu-img", "compare", "-f", "raw", "-F", "raw", raw, r.snapshot).CombinedOutput(); err != nil {
			r.fatalf("the snapshot changed: %v %s", err, out)
		}
	}
}

func firstLines(b []byte, n int) string {
	lines := strings.SplitN(string(b), "\n", n+1)
	return strings.Join(lines[:min(n, len(lines))], "\n")
}

// startModel makes template tp in a fresh folder, and its model, and
// opens the image for a run. (Each run of the regular test makes its own:
// a data file is named by an absolute path, so a copy of the folder would
// share it. A fuzzing process makes each other template once and copies
// it, qemu-img and qemu-io being most of an input's time otherwise.)
func startModel(t testing.TB, tp modelTemplate, byQemu bool) *modelRun {
	work := t.TempDir()
	if d, err := os.MkdirTemp("/dev/shm", "qcowfs-model"); err == nil {
		work = d
		t.Cleanup(func() { os.RemoveAll(d) })
	}
	if byQemu || tp.name == "datafile" {
		makeModel(t, tp, work)
	} else {
		files, _ := fuzzTemplates.Load(tp.name)
		if files == nil {
			made := t.TempDir()
			makeModel(t, tp, made)
			m := map[string][]byte{}
			entries, _ := os.ReadDir(made)
			for _, e := range entries {
				b, err := os.ReadFile(filepath.Join(made, e.Name()))
				if err != nil {
					t.Fatal(err)
				}
				m[e.Name()] = b
			}
			files, _ = fuzzTemplates.LoadOrStore(tp.name, m)
		}
		for name, b := range files.(map[string][]byte) {
			if err := os.WriteFile(filepath.Join(work, name), b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	p := filepath.Join(work, "image.qcow2")
	model, err := os.OpenFile(filepath.Join(work, "model.raw"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { model.Close() })
	r := &modelRun{t: t, tpl: tp, path: p, model: model, byQemu: byQemu}
	if strings.HasPrefix(tp.name, "snapshot") {
		r.snapshot = filepath.Join(work, "s1.raw")
	}
	r.cs = clusterSizeOf(t, p)
	r.open()
	return r
}

// fuzzTemplates holds a fuzzing process's templates, made once: their
// files by name.
var fuzzTemplates sync.Map

// makeModel makes template tp in work as image.qcow2, with its model
// (model.raw, sparse: zeros are holes, so that qemu-img compare skips them
// at any size) and, with a snapshot, the snapshot's content (s1.raw).
func makeModel(t testing.TB, tp modelTemplate, work string) {
	p := filepath.Join(work, "image.qcow2")
	tp.make(t, work, p)
	raw := filepath.Join(work, "model.raw")
	qemu.Img(t, "convert", "-O", "raw", p, raw)
	qemu.Run(t, "fallocate", "--dig-holes", raw)
	if strings.HasPrefix(tp.name, "snapshot") {
		qemu.Img(t, "convert", "-l", "snapshot.name=s1", "-O", "raw", p, filepath.Join(work, "s1.raw"))
	}
}

func clusterSizeOf(t testing.TB, p string) int64 {
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var b [4]byte
	if _, err := f.ReadAt(b[:], 20); err != nil {
		t.Fatal(err)
	}
	return 1 << binary.BigEndian.Uint32(b[:])
}

// run applies the program prog (opBytes per step) and finishes.
func (r *modelRun) run(prog []byte, maxSteps int) {
	for n := 0; n+opBytes <= len(prog) && n/opBytes < maxSteps; n += opBytes {
		op := decodeOp(prog[n:n+opBytes], n/opBytes+1, r.img.Size(), r.cs, r.tpl.maxSize)
		r.apply(op)
	}
	r.finish()
}

// randomProgram is a seeded program of n steps.
func randomProgram(seed uint64, n int) []byte {
	rnd := rand.New(rand.NewPCG(seed, 31))
	b := make([]byte, n*opBytes)
	for i := range b {
		b[i] = byte(rnd.Uint32())
	}
	return b
}

// modelSeeds is how many random programs TestModelRandom runs per
// template (QCOWFS_MODEL_SEEDS=N for more).
func modelSeeds() int {
	n := 3
	if s := os.Getenv("QCOWFS_MODEL_SEEDS"); s != "" {
		fmt.Sscan(s, &n)
	}
	return n
}

// TestModelRandom runs seeded random programs of 40 steps on every
// template, checked against the model and by qemu-img.
func TestModelRandom(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io", "fallocate")
	t.Parallel() // (beside the package's other long tests; it has its own folders)
	for i, tp := range modelTemplates() {
		t.Run(tp.name, func(t *testing.T) {
			for seed := range uint64(modelSeeds()) {
				startModel(t, tp, true).run(randomProgram(seed*1000+uint64(i), 40), 40)
			}
		})
	}
}

// FuzzWrite is the model test over programs the fuzzer makes, seeded with
// TestModelRandom's. While fuzzing, each run is checked with the library's
// own Check (qemu-img would dominate the time); in the regular test run
// (the seeds and the inputs kept in testdata/fuzz), with qemu-img.
func FuzzWrite(f *testing.F) {
	qemu.Require(f, "qemu-img", "qemu-io", "fallocate")
	tpls := modelTemplates()
	for i := range tpls {
		f.Add(byte(i), randomProgram(uint64(i), 24))
	}
	fuzzing := flag.Lookup("test.fuzz") != nil && flag.Lookup("test.fuzz").Value.String() != ""
	f.Fuzz(func(t *testing.T, which byte, prog []byte) {
		startModel(t, tpls[int(which)%len(tpls)], !fuzzing).run(prog, 64)
	})
}
