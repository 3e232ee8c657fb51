package write

// Random programs over the three views of one disk (its raw file and two
// partition files), checked after every step against a model of the
// disk's bytes, and after unmount against qemu-img convert.

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// The programs' disk: 8 MiB, GPT, p1 3 MiB at 1 MiB, and p2 at sector
// 8195, 1.5 KiB past a page boundary, so that a page of p2 holds parts of
// two pages of the disk's file.
const (
	vmDisk    = 8 << 20
	vmP1Start = 1 << 20
	vmP1Size  = 3 << 20
	vmP2Start = 8195 * 512
	vmP2Size  = 6000 * 512
)

// viewSeeds is how many programs run per cache mode: QCOWFS_VIEW_SEEDS,
// else a few.
func viewSeeds(t *testing.T) int {
	if s := os.Getenv("QCOWFS_VIEW_SEEDS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			t.Fatalf("QCOWFS_VIEW_SEEDS=%q: want a number of programs", s)
		}
		return n
	}
	return 3
}

// viewSteps is how many steps a program takes.
const viewSteps = 40

// TestViewsModel runs seeded random programs that write through vm.raw,
// vm.raw.parts/p1 and vm.raw.parts/p2: pwrite of a few bytes to a few
// hundred KiB (partial pages among them), fallocate zero and punch, fsync,
// close (the files are opened again when next used, so that which view
// the kernel caches changes), writes through a shared mapping (msync),
// and loop devices attached to the views (with and without --direct-io),
// written and read with O_DIRECT. After every step, every view read with
// pread (and every attached loop device with O_DIRECT) equals the model;
// after unmount, qemu-img convert of every image equals its model and
// qemu-img check finds it clean. With and without the writeback cache;
// QCOWFS_VIEW_SEEDS=N runs N programs per mode. A failure names the seed
// and the program's last steps.
func TestViewsModel(t *testing.T) {
	qemu.Require(t, "sfdisk", "losetup")
	work := t.TempDir()
	disk := filepath.Join(work, "disk.img")
	if err := os.WriteFile(disk, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(disk, vmDisk); err != nil {
		t.Fatal(err)
	}
	harness.Partition(t, disk, fmt.Sprintf("label: gpt\nstart=%d, size=%d, type=linux\nstart=%d, size=%d, type=linux\n",
		vmP1Start/512, vmP1Size/512, vmP2Start/512, vmP2Size/512))
	blank, err := os.ReadFile(disk)
	if err != nil {
		t.Fatal(err)
	}
	seeds := viewSeeds(t)
	for mi, mode := range cacheModes {
		t.Run(mode.name, func(t *testing.T) {
			src := harness.SourceDir(t)
			for s := range seeds {
				qemu.Img(t, "convert", "-q", "-f", "raw", "-O", "qcow2", disk, filepath.Join(src, fmt.Sprintf("v%d.qcow2", s)))
			}
			m := harness.Racy.Mount(t, src, mode.args...)
			stop := m.Watchdog(t, time.Duration(seeds)*time.Minute)
			models := make([][]byte, seeds)
			for s := range seeds {
				seed := uint64(mi)<<32 | uint64(s)
				p := newViewProgram(t, m.Dir, fmt.Sprintf("v%d", s), seed, slices.Clone(blank))
				p.run(viewSteps)
				models[s] = p.model
				if t.Failed() {
					break
				}
			}
			stop()
			m.Unmount(t)
			m.NoPanics(t)
			for s, model := range models {
				if model == nil {
					continue
				}
				img := filepath.Join(src, fmt.Sprintf("v%d.qcow2", s))
				qemu.CheckClean(t, img)
				if i := harness.FirstDiff(qemu.RawBytes(t, img), model); i >= 0 {
					t.Errorf("program %d (seed %#x): qemu-img convert differs from the model at byte %d", s, uint64(mi)<<32|uint64(s), i)
				}
			}
			t.Logf("%d programs of %d steps", seeds, viewSteps)
		})
	}
}

// viewProgram is one random program over one disk's views, working in
// the disk's bytes [lo, hi) (all of them, or a region of its own while
// other programs work elsewhere in the disk).
type viewProgram struct {
	t      *testing.T
	seed   uint64
	lo, hi int64
	loops  bool // attaches loop devices
	worker bool // runs on a goroutine of its own, not the test's
	rng    *rand.Rand
	bytes  *rand.ChaCha8 // the data written, from the seed too
	views  []*viewFile
	model  []byte   // the disk's bytes, as they must read
	steps  []string // what the program did, for a failure's message
	buf    []byte   // aligned, for O_DIRECT
}

// viewFile is one view of the disk, with what the program holds open.
type viewFile struct {
	name        string
	path        string
	start, size int64
	f           *os.File // open read-write, or nil
	loop        string   // an attached loop device, or ""
	loopFile    *os.File // it, open with O_DIRECT
	detach      func()
}

func newViewProgram(t *testing.T, mnt, stem string, seed uint64, model []byte) *viewProgram {
	var key [32]byte
	binary.LittleEndian.PutUint64(key[:], seed)
	p := &viewProgram{t: t, seed: seed, lo: 0, hi: vmDisk, loops: true, rng: rand.New(rand.NewPCG(seed, 43)), bytes: rand.NewChaCha8(key), model: model, buf: harness.AlignedBlock(t, 256<<10)}
	raw := filepath.Join(mnt, stem+".raw")
	parts := filepath.Join(mnt, stem+".raw.parts")
	p.views = []*viewFile{
		{name: "raw", path: raw, start: 0, size: vmDisk},
		{name: "p1", path: filepath.Join(parts, "p1"), start: vmP1Start, size: vmP1Size},
		{name: "p2", path: filepath.Join(parts, "p2"), start: vmP2Start, size: vmP2Size},
	}
	return p
}

// hot are the disk ranges most steps fall in, where the views overlap:
// p1's first and a middle page run, p2's start (not page-aligned in the
// disk), and so that several steps meet in the same pages.
var hot = [][2]int64{
	{vmP1Start, vmP1Start + 64<<10},
	{vmP1Start + 1<<20, vmP1Start + 1<<20 + 32<<10},
	{vmP2Start - 8<<10, vmP2Start + 64<<10},
	{vmP2Start + 2<<20, vmP2Start + 2<<20 + 16<<10},
}

func (p *viewProgram) fatalf(format string, args ...any) {
	p.t.Helper()
	last := p.steps[max(0, len(p.steps)-12):]
	msg := fmt.Sprintf("seed %#x, step %d: %s\nthe program's last steps:\n  %s", p.seed, len(p.steps), fmt.Sprintf(format, args...), strings.Join(last, "\n  "))
	if p.worker {
		// (FailNow is for the test's goroutine.)
		p.t.Error(msg)
		runtime.Goexit()
	}
	p.t.Fatal(msg)
}

func (p *viewProgram) run(steps int) {
	defer p.closeAll()
	var views []*viewFile // the views of the region
	for _, v := range p.views {
		if v.start < p.hi && v.start+v.size > p.lo {
			views = append(views, v)
		}
	}
	for range steps {
		v := views[p.rng.IntN(len(views))]
		switch r := p.rng.IntN(100); {
		case r < 30:
			p.pwrite(v)
		case r < 37:
			p.fallocate(v, unix.FALLOC_FL_ZERO_RANGE, "zero")
		case r < 44:
			p.fallocate(v, unix.FALLOC_FL_PUNCH_HOLE, "punch")
		case r < 52:
			p.fsync(v)
		case r < 60:
			p.close(v)
		case r < 72:
			p.mmapWrite(v)
		case r < 80 && p.loops:
			p.toggleLoop(v)
		default:
			p.loopWrite(v)
		}
		p.check()
		if p.t.Failed() {
			return
		}
	}
}

// span picks n bytes at off in v: mostly in a hot range, of a few bytes
// up to a few hundred KiB, at most limit.
func (p *viewProgram) span(v *viewFile, limit int64) (off, n int64) {
	switch p.rng.IntN(4) {
	case 0:
		n = 1 + p.rng.Int64N(16)
	case 1:
		n = 17 + p.rng.Int64N(4096)
	case 2:
		n = 4096 * (1 + p.rng.Int64N(8))
	default:
		n = 1 + p.rng.Int64N(256<<10)
	}
	lo, hi := max(p.lo-v.start, 0), min(p.hi-v.start, v.size) // the region
	if p.lo == 0 && p.hi == vmDisk && p.rng.IntN(5) > 0 {
		h := hot[p.rng.IntN(len(hot))]
		if a, b := h[0]-v.start, h[1]-v.start; a < v.size && b > 0 {
			lo, hi = max(a, 0), min(b, v.size)
		}
	}
	n = min(n, limit, hi-lo)
	off = lo + p.rng.Int64N(hi-lo)
	if off+n > hi {
		off = hi - n
	}
	return off, n
}

func (p *viewProgram) file(v *viewFile) *os.File {
	if v.f == nil {
		f, err := os.OpenFile(v.path, os.O_RDWR, 0)
		if err != nil {
			p.fatalf("open %s: %v", v.name, err)
		}
		v.f = f
	}
	return v.f
}

func (p *viewProgram) data(n int64) []byte {
	b := make([]byte, n)
	p.bytes.Read(b)
	return b
}

func (p *viewProgram) pwrite(v *viewFile) {
	off, n := p.span(v, 1<<20)
	p.steps = append(p.steps, fmt.Sprintf("pwrite %s %d+%d", v.name, off, n))
	b := p.data(n)
	if _, err := p.file(v).WriteAt(b, off); err != nil {
		p.fatalf("pwrite %s %d+%d: %v", v.name, off, n, err)
	}
	copy(p.model[v.start+off:], b)
}

func (p *viewProgram) fallocate(v *viewFile, mode uint32, what string) {
	off, n := p.span(v, 1<<20)
	p.steps = append(p.steps, fmt.Sprintf("%s %s %d+%d", what, v.name, off, n))
	if err := unix.Fallocate(int(p.file(v).Fd()), mode|unix.FALLOC_FL_KEEP_SIZE, off, n); err != nil {
		p.fatalf("fallocate %s %s %d+%d: %v", what, v.name, off, n, err)
	}
	clear(p.model[v.start+off:][:n])
}

func (p *viewProgram) fsync(v *viewFile) {
	p.steps = append(p.steps, "fsync "+v.name)
	if err := p.file(v).Sync(); err != nil {
		p.fatalf("fsync %s: %v", v.name, err)
	}
}

func (p *viewProgram) close(v *viewFile) {
	p.steps = append(p.steps, "close "+v.name)
	if v.f != nil {
		if err := v.f.Close(); err != nil {
			p.fatalf("close %s: %v", v.name, err)
		}
		v.f = nil
	}
}

// mmapWrite stores into a shared mapping of the pages around a span,
// then msyncs and unmaps it.
func (p *viewProgram) mmapWrite(v *viewFile) {
	off, n := p.span(v, 64<<10)
	p.steps = append(p.steps, fmt.Sprintf("mmap-write %s %d+%d", v.name, off, n))
	page := off &^ 4095
	mem, err := unix.Mmap(int(p.file(v).Fd()), page, int(off+n-page), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		p.fatalf("mmap %s at %d: %v", v.name, page, err)
	}
	b := p.data(n)
	copy(mem[off-page:], b)
	err = unix.Msync(mem, unix.MS_SYNC)
	if uerr := unix.Munmap(mem); err == nil {
		err = uerr
	}
	if err != nil {
		p.fatalf("msync or munmap %s: %v", v.name, err)
	}
	copy(p.model[v.start+off:], b)
}

// toggleLoop attaches a loop device to v, or detaches v's.
func (p *viewProgram) toggleLoop(v *viewFile) {
	if v.loop != "" {
		p.steps = append(p.steps, "loop-detach "+v.name)
		v.loopFile.Close()
		v.detach()
		v.loop, v.loopFile, v.detach = "", nil, nil
		return
	}
	flags := []string{}
	if p.rng.IntN(2) == 0 {
		flags = append(flags, "--direct-io=on")
	}
	p.steps = append(p.steps, fmt.Sprintf("loop-attach %s %s", v.name, strings.Join(flags, " ")))
	v.loop, v.detach = harness.AttachLoop(p.t, v.path, flags...)
	f, err := os.OpenFile(v.loop, os.O_RDWR|unix.O_DIRECT, 0)
	if err != nil {
		p.fatalf("open %s: %v", v.loop, err)
	}
	v.loopFile = f
}

// loopWrite writes whole sectors through v's loop device, O_DIRECT (past
// the device's own page cache); or, without one, pwrites.
func (p *viewProgram) loopWrite(v *viewFile) {
	if v.loop == "" {
		p.pwrite(v)
		return
	}
	off, n := p.span(v, int64(len(p.buf)))
	off, end := off&^511, (off+n+511)&^511
	if end > v.size {
		end = v.size &^ 511
	}
	n = end - off
	p.steps = append(p.steps, fmt.Sprintf("loop-write %s %d+%d", v.name, off, n))
	b := p.buf[:n]
	p.bytes.Read(b)
	if _, err := v.loopFile.WriteAt(b, off); err != nil {
		p.fatalf("write %s (loop of %s) %d+%d: %v", v.loop, v.name, off, n, err)
	}
	copy(p.model[v.start+off:], b)
}

// check reads every view's part of the region, with pread through the
// program's open file (or a new one, closed after), and every loop device
// with O_DIRECT, and compares with the model.
func (p *viewProgram) check() {
	for _, v := range p.views {
		lo, hi := max(p.lo-v.start, 0), min(p.hi-v.start, v.size)
		if lo >= hi {
			continue
		}
		want := p.model[v.start+lo : v.start+hi]
		got := make([]byte, hi-lo)
		f := v.f
		if f == nil {
			var err error
			if f, err = os.Open(v.path); err != nil {
				p.fatalf("open %s: %v", v.name, err)
			}
		}
		n, err := f.ReadAt(got, lo)
		if f != v.f {
			f.Close()
		}
		if err != nil || n != len(got) {
			p.fatalf("read %s %d+%d: %d bytes, %v", v.name, lo, hi-lo, n, err)
		}
		if i := harness.FirstDiff(got, want); i >= 0 {
			p.fatalf("%s reads %#x at %d (disk byte %d), the model %#x", v.name, got[i], lo+int64(i), v.start+lo+int64(i), want[i])
		}
		if v.loop == "" {
			continue
		}
		lo, hi = lo&^511, (hi+511)&^511
		for off := lo; off < hi; off += int64(len(p.buf)) {
			b := p.buf[:min(int64(len(p.buf)), hi-off)]
			if _, err := v.loopFile.ReadAt(b, off); err != nil {
				p.fatalf("read %s (loop of %s) at %d: %v", v.loop, v.name, off, err)
			}
			if i := harness.FirstDiff(b, p.model[v.start+off:][:len(b)]); i >= 0 {
				p.fatalf("%s (loop of %s) reads %#x at %d, the model %#x", v.loop, v.name, b[i], off+int64(i), p.model[v.start+off+int64(i)])
			}
		}
	}
}

func (p *viewProgram) closeAll() {
	for _, v := range p.views {
		if v.loop != "" {
			v.loopFile.Close()
			v.detach()
			v.loop = ""
		}
		if v.f != nil {
			if err := v.f.Close(); err != nil {
				p.t.Errorf("seed %#x: close %s: %v", p.seed, v.name, err)
			}
			v.f = nil
		}
	}
}

// TestViewsConcurrent runs four programs at once over one disk, each in a
// region of its own inside a partition (so that it writes and reads
// through all three views), the regions at least a page apart in every
// view's offsets: no page of any view holds bytes of two regions, so each
// program's reads of its region must equal its model whatever the others
// do meanwhile, and the image after unmount the model of all four. Their
// requests meet in the daemon: faults and writebacks of one view while
// another writes through its own, notifications crossing. A program that
// does not finish within minutes is a deadlock: the watchdog prints the
// daemon's threads' kernel stacks and aborts the FUSE connection.
func TestViewsConcurrent(t *testing.T) {
	qemu.Require(t, "sfdisk")
	work := t.TempDir()
	disk := filepath.Join(work, "disk.img")
	if err := os.WriteFile(disk, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(disk, vmDisk); err != nil {
		t.Fatal(err)
	}
	harness.Partition(t, disk, fmt.Sprintf("label: gpt\nstart=%d, size=%d, type=linux\nstart=%d, size=%d, type=linux\n",
		vmP1Start/512, vmP1Size/512, vmP2Start/512, vmP2Size/512))
	blank, err := os.ReadFile(disk)
	if err != nil {
		t.Fatal(err)
	}
	regions := [][2]int64{
		{vmP1Start + 64<<10, vmP1Start + 320<<10},
		{vmP1Start + 400<<10, vmP1Start + 656<<10},
		{vmP2Start + 64<<10, vmP2Start + 320<<10},
		{vmP2Start + 400<<10, vmP2Start + 656<<10},
	}
	for mi, mode := range cacheModes {
		t.Run(mode.name, func(t *testing.T) {
			src := harness.SourceDir(t)
			img := filepath.Join(src, "v.qcow2")
			qemu.Img(t, "convert", "-q", "-f", "raw", "-O", "qcow2", disk, img)
			m := harness.Racy.Mount(t, src, mode.args...)
			stop := m.Watchdog(t, 3*time.Minute)
			model := slices.Clone(blank)
			var wg sync.WaitGroup
			for i, r := range regions {
				p := newViewProgram(t, m.Dir, "v", uint64(mi)<<32|uint64(i)<<16, model)
				p.lo, p.hi, p.loops, p.worker = r[0], r[1], false, true
				wg.Go(func() { p.run(viewSteps) })
			}
			wg.Wait()
			stop()
			m.Unmount(t)
			m.NoPanics(t)
			qemu.CheckClean(t, img)
			if i := harness.FirstDiff(qemu.RawBytes(t, img), model); i >= 0 {
				t.Errorf("qemu-img convert differs from the model at byte %d", i)
			}
		})
	}
}
