package qcow2_test

import (
	"bytes"
	"cmp"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// Crash consistency, tested the way file systems are tested: a workload
// runs with its host I/O recorded (writelog_test.go); then the disk is
// rebuilt at every sync, at every prefix of the writes since the last sync,
// and for random subsets of them in random order, some torn, and each
// state must pass:
//
//   - qemu-img check: no corruption (leaks are allowed, and counted);
//   - the image opens again in qcowfs, read-write;
//   - the data check qemu-img check cannot do: every 512-byte sector holds
//     its value as of the last flush that returned before the crash, or
//     the value of a later write to that same sector; never another
//     sector's data, never an older value. (Guest data carries its sector
//     number and the write's number, qemu.Op.Data.)

// crashDir is where crash states are rebuilt: memory, where there is one.
func crashDir(t *testing.T) string {
	if d, err := os.MkdirTemp("/dev/shm", "qcowfs-crash"); err == nil {
		t.Cleanup(func() { os.RemoveAll(d) })
		return d
	}
	return qemu.TempDir(t)
}

// A crashWorkload is an image to make and a sequence of guest operations.
type crashWorkload struct {
	name string
	// make builds the image in dir and returns it, the files the writer
	// writes (relative to dir: the image, and its data file if any), and
	// its cluster size.
	make func(t *testing.T, dir string) (image string, written []string, cs int64)
	ops  func(size, cs int64) []qemu.Op
}

// sectorOps returns n seeded operations aligned to sectors: writes of 1 to
// 64 sectors (some whole clusters, some across them), discards and
// zeroings, a flush every few operations.
func sectorOps(seed uint64, n int, size, cs int64, resize int64) []qemu.Op {
	r := rand.New(rand.NewPCG(seed, 11))
	var ops []qemu.Op
	for i := 1; i <= n; i++ {
		op := qemu.Op{N: i}
		switch k := r.IntN(10); {
		case i%4 == 0:
			op.Kind = qemu.OpFlush
		case resize > 0 && i == n/2:
			op.Kind, op.Off = qemu.OpResize, resize
			size = resize
		case k < 6:
			op.Kind = qemu.OpWrite
		case k < 8:
			op.Kind = qemu.OpDiscard
		default:
			op.Kind = qemu.OpZero
		}
		if op.Kind == qemu.OpWrite || op.Kind == qemu.OpDiscard || op.Kind == qemu.OpZero {
			sectors := size / 512
			s := r.Int64N(sectors)
			var n int64
			switch r.IntN(3) {
			case 0:
				s = s * 512 / cs * cs / 512 // a cluster's start
				n = cs / 512 * (1 + r.Int64N(2))
			default:
				n = 1 + r.Int64N(64)
			}
			n = min(n, sectors-s)
			op.Off, op.Len = s*512, n*512
		}
		ops = append(ops, op)
	}
	return ops
}

func crashWorkloads() []crashWorkload {
	create := func(name, size string, opts ...string) func(t *testing.T, dir string) (string, []string, int64) {
		return func(t *testing.T, dir string) (string, []string, int64) {
			p := filepath.Join(dir, name+".qcow2")
			qemu.Create(t, "qcow2", p, size, opts...)
			return p, []string{name + ".qcow2"}, clusterOf(t, p)
		}
	}
	ops := func(seed uint64, n int) func(size, cs int64) []qemu.Op {
		return func(size, cs int64) []qemu.Op { return sectorOps(seed, n, size, cs, 0) }
	}
	return []crashWorkload{
		{"alloc-empty", create("alloc", "8M"), ops(1, 24)},
		{"alloc-4k", create("alloc4k", "8M", "-o", "cluster_size=4096"), ops(2, 24)},
		{"cow-backing", func(t *testing.T, dir string) (string, []string, int64) {
			base := filepath.Join(dir, "base.qcow2")
			qemu.Create(t, "qcow2", base, "8M")
			qemu.IO(t, base, "write -P 0xb5 0 8M")
			p := filepath.Join(dir, "over.qcow2")
			qemu.Create(t, "qcow2", p, "8M", "-b", "base.qcow2", "-F", "qcow2")
			return p, []string{"over.qcow2"}, 65536
		}, ops(3, 24)},
		{"cow-compressed", func(t *testing.T, dir string) (string, []string, int64) {
			raw := filepath.Join(dir, "c.raw")
			qemu.Create(t, "raw", raw, "8M")
			qemu.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x3c 0 8M", raw)
			p := filepath.Join(dir, "c.qcow2")
			qemu.Img(t, "convert", "-q", "-c", "-O", "qcow2", raw, p)
			return p, []string{"c.qcow2"}, 65536
		}, ops(4, 24)},
		{"cow-snapshot", func(t *testing.T, dir string) (string, []string, int64) {
			p := filepath.Join(dir, "s.qcow2")
			qemu.Create(t, "qcow2", p, "8M", "-o", "cluster_size=4096")
			qemu.IO(t, p, "write -P 0x51 0 8M")
			qemu.Img(t, "snapshot", "-c", "snap", p)
			return p, []string{"s.qcow2"}, 4096
		}, ops(5, 24)},
		{"discard-realloc", create("d", "4M", "-o", "cluster_size=4096"), func(size, cs int64) []qemu.Op {
			// Fill, flush, discard much, flush, write again: freed
			// clusters come back into use.
			var o []qemu.Op
			n := 1
			add := func(k qemu.OpKind, off, l int64) {
				o = append(o, qemu.Op{Kind: k, Off: off, Len: l, N: n})
				n++
			}
			add(qemu.OpWrite, 0, 1<<20)
			add(qemu.OpFlush, 0, 0)
			add(qemu.OpDiscard, 0, 768<<10)
			add(qemu.OpFlush, 0, 0)
			for i := int64(0); i < 8; i++ {
				add(qemu.OpWrite, 2<<20+i*65536, 32768)
				if i%3 == 2 {
					add(qemu.OpFlush, 0, 0)
				}
			}
			add(qemu.OpFlush, 0, 0)
			return o
		}},
		{"resize-moves-l1", create("r", "8M", "-o", "cluster_size=512"), func(size, cs int64) []qemu.Op {
			// 512 B clusters: an L1 entry maps 32 KiB, so 8 MiB need
			// four clusters of L1 table and 16 MiB eight: the table
			// moves.
			return sectorOps(6, 20, size, cs, 16<<20)
		}},
		{"reftable-growth", create("g", "12M", "-o", "cluster_size=512"), func(size, cs int64) []qemu.Op {
			// 512 B clusters, 16-bit refcounts: the first refcount table
			// cluster counts 8 MiB of clusters.
			var o []qemu.Op
			for i := int64(0); i < 5; i++ {
				o = append(o, qemu.Op{Kind: qemu.OpWrite, Off: i * 2 << 20, Len: 2 << 20, N: len(o) + 1})
				o = append(o, qemu.Op{Kind: qemu.OpFlush, N: len(o) + 1})
			}
			return o
		}},
		{"stream", create("st", "8M"), func(size, cs int64) []qemu.Op {
			// A guest streaming 1 MiB writes, which FUSE sends as
			// 1016 KiB and 8 KiB: the large ones go with O_DIRECT and
			// stay in flight (behind.go), the small ones behind them;
			// a write inside one in flight, a discard of one, and the
			// space written again.
			var o []qemu.Op
			add := func(k qemu.OpKind, off, l int64) {
				o = append(o, qemu.Op{Kind: k, Off: off, Len: l, N: len(o) + 1})
			}
			for i := int64(0); i < 4; i++ {
				add(qemu.OpWrite, i<<20, 1016<<10)
				add(qemu.OpWrite, i<<20+1016<<10, 8<<10)
				if i == 1 {
					add(qemu.OpWrite, i<<20+300<<10, 4<<10)
				}
			}
			add(qemu.OpFlush, 0, 0)
			add(qemu.OpWrite, 4<<20, 2<<20)
			add(qemu.OpDiscard, 4<<20, 1<<20)
			add(qemu.OpWrite, 4<<20+512<<10, 512<<10)
			add(qemu.OpWrite, 0, 512<<10)
			add(qemu.OpFlush, 0, 0)
			add(qemu.OpWrite, 6<<20, 1<<20)
			add(qemu.OpZero, 6<<20+256<<10, 256<<10)
			add(qemu.OpFlush, 0, 0)
			return o
		}},
		{"extended-l2", func(t *testing.T, dir string) (string, []string, int64) {
			base := filepath.Join(dir, "xbase.qcow2")
			qemu.Create(t, "qcow2", base, "8M")
			qemu.IO(t, base, "write -P 0xe1 0 8M")
			p := filepath.Join(dir, "x.qcow2")
			qemu.Create(t, "qcow2", p, "8M", "-b", "xbase.qcow2", "-F", "qcow2", "-o", "extended_l2=on,cluster_size=65536")
			return p, []string{"x.qcow2"}, 65536
		}, ops(7, 24)},
		{"encrypted", func(t *testing.T, dir string) (string, []string, int64) {
			// LUKS with AES-256-XTS, 4 KiB clusters: copy-on-write
			// re-encrypts, sub-sector writes are read-merged.
			p := filepath.Join(dir, "e.qcow2")
			qemu.Img(t, "create", "-q", "-f", "qcow2", "--object", "secret,id=s0,data="+crashSecret,
				"-o", "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10,cluster_size=4096", p, "8M")
			return p, []string{"e.qcow2"}, 4096
		}, ops(9, 24)},
		{"bitmaps", func(t *testing.T, dir string) (string, []string, int64) {
			// Two enabled bitmaps and a disabled one: in use from
			// before the first write, consistent again only after a
			// clean close. Every cluster is allocated before the
			// bitmaps are added, so that the workload's writes land in
			// place, visible before any flush stores a bitmap.
			p := filepath.Join(dir, "b.qcow2")
			qemu.Create(t, "qcow2", p, "8M", "-o", "cluster_size=4096")
			qemu.IO(t, p, "write -P 0x5b 0 8M")
			qemu.Img(t, "bitmap", "--add", "-g", "65536", p, "b64k")
			qemu.Img(t, "bitmap", "--add", "-g", "1M", p, "b1m")
			qemu.Img(t, "bitmap", "--add", "--disable", p, "off")
			return p, []string{"b.qcow2"}, 4096
		}, ops(10, 24)},
		{"data-file", func(t *testing.T, dir string) (string, []string, int64) {
			p := filepath.Join(dir, "df.qcow2")
			qemu.Create(t, "qcow2", p, "8M", "-o", "data_file="+filepath.Join(dir, "df.data")+",data_file_raw=on")
			return p, []string{"df.qcow2", "df.data"}, 65536
		}, ops(8, 24)},
	}
}

func clusterOf(t *testing.T, p string) int64 {
	return int64(qemu.Info(t, p)["cluster-size"].(float64))
}

// The encrypted workload's passphrase, for the library and for qemu.
const crashSecret = "crash test"

func crashPassphrase(string) []byte { return []byte(crashSecret) }

// crashImageArgs are the arguments naming image to qemu-img: the file, or
// for an encrypted image the secret and --image-opts.
func crashImageArgs(image string) []string {
	b := make([]byte, 36)
	if f, err := os.Open(image); err == nil {
		f.ReadAt(b, 0)
		f.Close()
	}
	if b[35] == 0 {
		return []string{image}
	}
	return []string{"--object", "secret,id=cs,data=" + crashSecret, "--image-opts", "driver=qcow2,file.filename=" + image + ",encrypt.key-secret=cs"}
}

// crashRaw converts image to raw at raw with qemu-img, and returns raw.
func crashRaw(t *testing.T, image, raw string) string {
	qemu.Img(t, append(append([]string{"convert"}, crashImageArgs(image)...), "-O", "raw", raw)...)
	return raw
}

// copyFiles copies the named files from src to dst. Within one file
// system (crashDir's) the kernel copies them (copy_file_range), not
// through a buffer of the test's, which the race detector would have to
// follow byte by byte at every crash state.
func copyFiles(t *testing.T, src, dst string, names []string) {
	t.Helper()
	for _, n := range names {
		in, err := os.Open(filepath.Join(src, n))
		if err != nil {
			t.Fatal(err)
		}
		out, err := os.OpenFile(filepath.Join(dst, n), os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
		if err == nil {
			_, err = io.Copy(out, in)
			if cerr := out.Close(); err == nil {
				err = cerr
			}
		}
		in.Close()
		if err != nil {
			t.Fatal(err)
		}
	}
}

// sectorHistory knows, for the data check, what each sector may hold.
type sectorHistory struct {
	initial []byte // the disk before the workload
	ops     []qemu.Op
	data    map[int][]byte // what each write op writes, made once
	// failed are the ops (by number) that returned an error: each may
	// or may not have happened, sector by sector, however many flushes
	// succeeded after it. (More than one fails where the first makes
	// the next impossible: a grow that failed, then a write past the
	// old end.)
	failed map[int]bool
	// disk is dataCheck's buffer for the disk, one for all the states
	// (a fresh one each time was most of the memory the test churned,
	// and under the race detector most of its time); ReadAt fills it,
	// holes included.
	disk []byte
	// touched are the sectors some op writes, zeroes or discards, as
	// sorted, merged [start, end) sector ranges (made on first use): any
	// other sector may only hold its initial content, which is checked
	// without looking at every op (most of the disk, once a grow makes
	// it large: under the race detector the per-op loop was most of the
	// crash tests' time).
	touched [][2]int64
}

// untouched reports whether no op changes sector s.
func (h *sectorHistory) untouched(s int64) bool {
	if h.touched == nil {
		var rs [][2]int64
		for _, op := range h.ops {
			if op.Kind == qemu.OpWrite || op.Kind == qemu.OpDiscard || op.Kind == qemu.OpZero {
				rs = append(rs, [2]int64{op.Off / 512, (op.Off + op.Len + 511) / 512})
			}
		}
		slices.SortFunc(rs, func(a, b [2]int64) int { return cmp.Compare(a[0], b[0]) })
		h.touched = [][2]int64{}
		for _, r := range rs {
			if n := len(h.touched); n > 0 && r[0] <= h.touched[n-1][1] {
				h.touched[n-1][1] = max(h.touched[n-1][1], r[1])
				continue
			}
			h.touched = append(h.touched, r)
		}
	}
	i, _ := slices.BinarySearchFunc(h.touched, s, func(r [2]int64, s int64) int {
		switch {
		case r[1] <= s:
			return -1
		case r[0] > s:
			return 1
		}
		return 0
	})
	return i == len(h.touched) || h.touched[i][0] > s || h.touched[i][1] <= s
}

// initialSector is what sector s held before the workload.
func (h *sectorHistory) initialSector(s int64) []byte {
	if (s+1)*512 <= int64(len(h.initial)) {
		return h.initial[s*512 : (s+1)*512]
	}
	return zeroSector[:]
}

var zeroSector [512]byte

// allowed reports whether sector s may read as got after a crash in which
// the ops up to acked (by number) are acknowledged by a flush and the ops
// up to issued began.
func (h *sectorHistory) allowed(s int64, got []byte, acked, issued int) (bool, string) {
	off := s * 512
	// The values the sector may hold: the last acknowledged one, and
	// every later one.
	type value struct {
		zero bool
		op   int // 0: the initial content
	}
	last := value{op: 0}
	var later []value
	for _, op := range h.ops {
		if op.N > issued {
			break
		}
		var v value
		switch op.Kind {
		case qemu.OpWrite:
			if off < op.Off || off >= op.Off+op.Len {
				continue
			}
			v = value{op: op.N}
		case qemu.OpDiscard, qemu.OpZero:
			if off < op.Off || off >= op.Off+op.Len {
				continue
			}
			v = value{zero: true, op: op.N}
		default:
			continue
		}
		if op.N <= acked && !h.failed[op.N] {
			last = v
		} else {
			later = append(later, v)
		}
	}
	matches := func(v value) bool {
		switch {
		case v.zero:
			return allZero(got)
		case v.op == 0:
			if off+512 <= int64(len(h.initial)) {
				return bytes.Equal(got, h.initial[off:off+512])
			}
			return allZero(got) // past the initial end: zeros
		default:
			op := h.ops[v.op-1]
			d := h.data[op.N]
			if d == nil {
				d = op.Data()
				h.data[op.N] = d
			}
			at := off - op.Off
			return bytes.Equal(got, d[at:at+512])
		}
	}
	if matches(last) {
		return true, ""
	}
	for _, v := range later {
		if matches(v) {
			return true, ""
		}
	}
	what := "garbage"
	if len(got) >= 12 && !allZero(got) {
		what = fmt.Sprintf("sector %d's data of op %d", binary.BigEndian.Uint64(got), binary.BigEndian.Uint32(got[8:]))
	} else if allZero(got) {
		what = "zeros"
	}
	return false, fmt.Sprintf("sector %d reads %s; the last acknowledged value is %+v, later ones %+v", s, what, last, later)
}

// crashResult counts what the states showed.
type crashResult struct {
	states, leakStates, leaks, corruptions, dataFailures int
}

// TestCrashConsistency runs every crash workload with its host I/O logged
// and checks every crash state its log allows (see the top of the file).
//
// The workloads are independent (each in folders of its own) and run in
// parallel, beside TestInjectedErrors's: most of their time is single
// threaded (the states checked one by one, qemu-img check on each).
func TestCrashConsistency(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	t.Parallel()
	var mu sync.Mutex
	var total crashResult
	// After every workload's subtest (Cleanup waits for the parallel
	// ones).
	t.Cleanup(func() {
		t.Logf("all workloads: %d crash states checked, %d with leaks (%d leaked clusters), %d corruptions, %d data-check failures",
			total.states, total.leakStates, total.leaks, total.corruptions, total.dataFailures)
		if p := os.Getenv("QCOWFS_CRASH_REPORT"); p != "" {
			os.WriteFile(p, fmt.Appendf(nil, "%d states, %d with leaks (%d clusters), %d corruptions, %d data-check failures\n",
				total.states, total.leakStates, total.leaks, total.corruptions, total.dataFailures), 0o644)
		}
	})
	for _, wl := range crashWorkloads() {
		t.Run(wl.name, func(t *testing.T) {
			t.Parallel()
			res := runCrashWorkload(t, wl, 3)
			t.Logf("%s: %d states, %d with leaks (%d leaked clusters), %d corruptions, %d data-check failures",
				wl.name, res.states, res.leakStates, res.leaks, res.corruptions, res.dataFailures)
			mu.Lock()
			defer mu.Unlock()
			total.states += res.states
			total.leakStates += res.leakStates
			total.leaks += res.leaks
			total.corruptions += res.corruptions
			total.dataFailures += res.dataFailures
		})
	}
}

// setUp makes wl's image in a crash folder (dir) and keeps a copy of the
// files the workload writes in base, a crash folder too (copyFiles copies
// within the tmpfs in the kernel); it returns them with what qemu-img
// convert reads of the image before the workload, and its operations.
func (wl crashWorkload) setUp(t *testing.T) (dir, base, image string, written []string, initial []byte, ops []qemu.Op) {
	t.Helper()
	dir, base = crashDir(t), crashDir(t)
	image, written, cs := wl.make(t, dir)
	initial, err := os.ReadFile(crashRaw(t, image, filepath.Join(base, "initial.raw")))
	if err != nil {
		t.Fatal(err)
	}
	copyFiles(t, dir, base, written)
	return dir, base, image, written, initial, wl.ops(int64(len(initial)), cs)
}

func runCrashWorkload(t *testing.T, wl crashWorkload, random int) crashResult {
	dir, base, image, written, initial, ops := wl.setUp(t)

	// The workload, logged.
	log := &writeLog{}
	f, err := qcow2.OpenWritableFile(image)
	if err != nil {
		t.Fatal(err)
	}
	opener := &loggingOpener{log: log}
	if len(written) > 1 {
		opener.name = written[1]
	}
	img, err := qcow2.NewImage(log.wrap(f, written[0]), qcow2.Options{Writable: true, Opener: opener, Passphrase: crashPassphrase})
	if err != nil || !img.Writable() {
		t.Fatalf("open: %v %s", err, img.ReadOnlyReason())
	}
	for _, op := range ops {
		log.mark(op.N)
		apply(t, img, op)
		if op.Kind == qemu.OpFlush {
			log.mark(-op.N)
		}
	}
	last := len(ops) + 1
	log.mark(last)
	if err := img.Close(); err != nil {
		t.Fatal(err)
	}
	log.mark(-last)
	h := &sectorHistory{initial: initial, ops: ops, data: map[int][]byte{}}

	// Every state.
	r := rand.New(rand.NewPCG(uint64(len(log.entries)), 5))
	var res crashResult
	for _, st := range log.crashStates(r, random) {
		res.states++
		copyFiles(t, base, dir, written)
		if err := log.replayTo(dir, log.entries[:st.synced], nil, -1, 0); err != nil {
			t.Fatal(err)
		}
		if len(st.keep) > 0 {
			if err := log.replayTo(dir, log.entries, st.keep, st.torn, st.tornMask); err != nil {
				t.Fatal(err)
			}
		}
		// acked: the ops acknowledged by the last flush that returned
		// before the crash; issued: the ops begun.
		acked, issued := 0, 0
		for _, e := range log.entries[:st.end] {
			if e.kind != logMark {
				continue
			}
			if e.mark < 0 {
				acked = -e.mark - 1
				if -e.mark == last {
					acked = len(ops)
				}
			} else {
				issued = min(e.mark, len(ops))
			}
		}
		leaks, corrupt, msg := checkState(t, image)
		if corrupt {
			res.corruptions++
			t.Errorf("%s: qemu-img check finds corruption:\n%s", st.what, msg)
			continue
		}
		if leaks > 0 {
			res.leakStates++
			res.leaks += leaks
		}
		if failed := bitmapCheck(t, image, initial, st.what); failed {
			res.dataFailures++
		}
		if failed := dataCheck(t, image, h, acked, issued, st.what); failed {
			res.dataFailures++
		}
		if res.corruptions+res.dataFailures > 3 {
			t.Fatal("too many failures")
		}
	}
	return res
}

// bitmapCheck checks a crash state's persistent bitmaps: one that is
// enabled and not in use must, as qemu reads it, hold every sector of the
// disk that no longer reads as it did before the workload (a bitmap in use
// is inconsistent, and qemu treats it so). It reports whether one did not.
func bitmapCheck(t *testing.T, image string, initial []byte, what string) bool {
	img, err := qcow2.Open(image, qcow2.Options{NoBacking: true, LenientTables: true, Passphrase: crashPassphrase})
	if err != nil {
		return false // (the data check says why)
	}
	var bitmaps []qcow2.Bitmap
	for _, b := range img.Bitmaps() {
		if slices.Contains(b.Flags, "auto") && !slices.Contains(b.Flags, "in-use") {
			bitmaps = append(bitmaps, b)
		}
	}
	if len(bitmaps) == 0 {
		img.Close()
		return false // nothing to check: no need to read the disk
	}
	disk := make([]byte, img.Size())
	_, err = img.ReadAt(disk, 0)
	img.Close()
	if err != nil {
		return false
	}
	for _, b := range bitmaps {
		dirty := qemu.DirtyRanges(t, image, b.Name)
		covered := func(s, e int64) bool {
			for _, d := range dirty {
				if d[0] <= s && e <= d[1] {
					return true
				}
			}
			return false
		}
		for s := int64(0); s*512 < int64(len(disk)); s++ {
			was := make([]byte, 512)
			if s*512 < int64(len(initial)) {
				copy(was, initial[s*512:])
			}
			if !bytes.Equal(disk[s*512:(s+1)*512], was) && !covered(s*512, (s+1)*512) {
				t.Errorf("%s: bitmap %s is consistent (not in use) but misses changed sector %d: dirty %v", what, b.Name, s, dirty)
				return true
			}
		}
	}
	return false
}

// checkState runs qemu-img check on a crash state: leaked clusters are
// allowed; corruption, or a check that cannot run, is not.
func checkState(t *testing.T, image string) (leaks int, corrupt bool, msg string) {
	out, err := exec.Command("qemu-img", append([]string{"check", "--output=json"}, crashImageArgs(image)...)...).Output()
	var res struct {
		CheckErrors int `json:"check-errors"`
		Corruptions int `json:"corruptions"`
		Leaks       int `json:"leaks"`
	}
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	}
	if jerr := json.Unmarshal(out, &res); jerr != nil || (code != 0 && code != 3) || res.Corruptions+res.CheckErrors > 0 {
		human, _ := exec.Command("qemu-img", append([]string{"check"}, crashImageArgs(image)...)...).CombinedOutput()
		return 0, true, fmt.Sprintf("exit %d: %s", code, human)
	}
	return res.Leaks, false, ""
}

// dataCheck opens the crash state read-write in qcowfs and checks every
// sector; it reports whether anything was wrong (and says what).
func dataCheck(t *testing.T, image string, h *sectorHistory, acked, issued int, what string) bool {
	f, err := qcow2.OpenWritableFile(image)
	if err != nil {
		t.Errorf("%s: %v", what, err)
		return true
	}
	img, err := qcow2.NewImage(f, qcow2.Options{Writable: true, Passphrase: crashPassphrase})
	if err == nil && !img.Writable() && strings.Contains(img.ReadOnlyReason(), "is in use") {
		// Bitmaps a crash left in use: read-only, rightly.
	} else if err != nil || !img.Writable() {
		t.Errorf("%s: the image does not open read-write again: %v %s", what, err, img.ReadOnlyReason())
		return true
	}
	defer img.Close()
	if ok, why := h.sizeAllowed(img.Size(), acked, issued); !ok {
		t.Errorf("%s (acknowledged up to op %d, issued %d): %s", what, acked, issued, why)
		return true
	}
	bad := 0
	for _, r := range h.checkedRanges(img, acked, issued) {
		for start := r[0]; start < r[1]; start += int64(checkChunk) {
			n := min(r[1]-start, int64(checkChunk))
			if int64(cap(h.disk)) < n {
				h.disk = make([]byte, n)
			}
			buf := h.disk[:n]
			if _, err := img.ReadAt(buf, start); err != nil {
				t.Errorf("%s: reading the disk at %d: %v", what, start, err)
				return true
			}
			for s := int64(0); s < n/512; s++ {
				sec, got := start/512+s, buf[s*512:(s+1)*512]
				if h.untouched(sec) && bytes.Equal(got, h.initialSector(sec)) {
					continue // (the only value it may hold)
				}
				if ok, why := h.allowed(sec, got, acked, issued); !ok {
					if bad == 0 {
						t.Errorf("%s (acknowledged up to op %d, issued %d): %s", what, acked, issued, why)
					}
					bad++
				}
			}
		}
	}
	return bad > 0
}

// checkChunk is how much of the disk dataCheck reads at a time.
const checkChunk = 8 << 20

// sizeAllowed reports whether a crash state's disk size is one the disk
// had as of the last acknowledged flush or got from a later grow: a grow
// that returned is never undone by a crash after the flush after it.
func (h *sectorHistory) sizeAllowed(size int64, acked, issued int) (bool, string) {
	want := int64(len(h.initial))
	var later []int64
	for _, op := range h.ops {
		if op.N > issued {
			break
		}
		if op.Kind != qemu.OpResize {
			continue
		}
		if op.N <= acked && !h.failed[op.N] {
			want = op.Off
		} else {
			later = append(later, op.Off)
		}
	}
	if size == want || slices.Contains(later, size) {
		return true, ""
	}
	return false, fmt.Sprintf("the disk is %d bytes; as of the last acknowledged flush it was %d, later grows %v", size, want, later)
}

// checkedRanges returns the guest ranges dataCheck reads: the whole disk
// when it is small; on a large sparse disk (a grow that moves the L1
// table of 64 KiB clusters makes one of terabytes) the initial content,
// every range an op up to issued touched and every range the image says
// holds data. Everything else must read zeros and may only: no op wrote
// there and it was past the initial content.
func (h *sectorHistory) checkedRanges(img *qcow2.Image, acked, issued int) [][2]int64 {
	size := img.Size()
	if size <= 256<<20 {
		return [][2]int64{{0, size}}
	}
	rs := [][2]int64{{0, min(size, int64(len(h.initial)))}}
	for _, op := range h.ops {
		if op.N > issued {
			break
		}
		if op.Kind == qemu.OpWrite || op.Kind == qemu.OpDiscard || op.Kind == qemu.OpZero {
			rs = append(rs, [2]int64{op.Off, op.Off + op.Len})
		}
	}
	for off := int64(0); off < size; {
		d, err := img.NextData(context.Background(), off)
		if err != nil {
			break
		}
		e, err := img.NextHole(context.Background(), d)
		if err != nil {
			e = size
		}
		rs = append(rs, [2]int64{d, e})
		off = e
	}
	// Sorted, clipped to the disk, whole sectors, merged.
	slices.SortFunc(rs, func(a, b [2]int64) int { return cmp.Compare(a[0], b[0]) })
	var out [][2]int64
	for _, r := range rs {
		r[0], r[1] = r[0]/512*512, min(size, (r[1]+511)/512*512)
		if r[0] >= r[1] {
			continue
		}
		if n := len(out); n > 0 && r[0] <= out[n-1][1] {
			out[n-1][1] = max(out[n-1][1], r[1])
			continue
		}
		out = append(out, r)
	}
	return out
}

// TestInjectedErrors makes the n-th host I/O of a workload (a write, punch,
// allocate, truncate or sync) fail, with EIO and with ENOSPC, for every n,
// as qemu's iotest 026 does with blkdebug. The operation that hits it fails,
// and every later flush fails too (nothing acknowledged after an error);
// the image on disk passes qemu-img check (leaks allowed) and every sector
// acknowledged by a flush before the failure reads back. A failed
// reservation of space (fallocate) has written nothing: it fails only the
// operation that needed it (and an ENOSPC there is retried smaller, so it
// may fail nothing), and later flushes succeed.
//
// Like TestCrashConsistency's, the workloads run in parallel.
func TestInjectedErrors(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	t.Parallel()
	for _, name := range []string{"alloc-4k", "cow-snapshot", "discard-realloc", "resize-moves-l1", "stream", "encrypted", "grow-512-r64-snap"} {
		var wl crashWorkload
		for _, w := range append(crashWorkloads(), growWorkloads(6, 0)...) {
			if w.name == name {
				wl = w
			}
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			dir, base, image, written, initial, ops := wl.setUp(t)
			h := &sectorHistory{initial: initial, ops: ops, data: map[int][]byte{}}

			// run runs the workload failing I/O failAt (0: none) and
			// returns the ops acknowledged by a flush and the I/Os made.
			run := func(failAt int, failErr error) (acked int, ios int, failedOps map[int]bool) {
				failedOps = map[int]bool{}
				copyFiles(t, base, dir, written)
				log := &writeLog{failAt: failAt, failErr: failErr}
				f, err := qcow2.OpenWritableFile(image)
				if err != nil {
					t.Fatal(err)
				}
				img, err := qcow2.NewImage(log.wrap(f, written[0]), qcow2.Options{Writable: true, Passphrase: crashPassphrase})
				if err != nil {
					t.Fatal(err)
				}
				var sawErr bool
				for _, op := range ops {
					err := applyOp(img, op)
					if op.Kind == qemu.OpFlush {
						if err == nil && sawErr && log.failedE.kind != logAllocate {
							t.Fatalf("fail at I/O %d: flush %d succeeded after an error", failAt, op.N)
						}
						if err == nil {
							acked = op.N - 1
						}
					}
					if err != nil {
						sawErr, failedOps[op.N] = true, true
					}
				}
				cerr := img.Close()
				if cerr == nil && !sawErr {
					acked = len(ops)
				}
				if log.failed && !sawErr && cerr == nil && !(log.failedE.kind == logAllocate && failErr == syscall.ENOSPC) {
					fe := log.failedE
					t.Fatalf("fail at I/O %d: the injected error was swallowed (a %d of %d bytes at %d)", failAt, fe.kind, fe.n, fe.off)
				}
				return acked, log.ios, failedOps
			}
			_, total, _ := run(0, nil)
			runs, leaky := 0, 0
			for n := 1; n <= total; n++ {
				for _, e := range []error{syscall.EIO, syscall.ENOSPC} {
					acked, _, failedOps := run(n, e)
					h.failed = failedOps
					runs++
					leaks, corrupt, msg := checkState(t, image)
					if corrupt {
						t.Fatalf("I/O %d failing with %v: qemu-img check finds corruption:\n%s", n, e, msg)
					}
					if leaks > 0 {
						leaky++
					}
					if dataCheck(t, image, h, acked, len(ops), fmt.Sprintf("I/O %d failing with %v", n, e)) {
						t.FailNow()
					}
				}
			}
			t.Logf("%s: %d I/Os, %d failing runs checked, %d with leaks, 0 corruptions, 0 data-check failures", name, total, runs, leaky)
		})
	}
}
