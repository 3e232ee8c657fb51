package write

// Writes that meet failures: a host file system with no room left
// (ENOSPC), a daemon killed mid-write (kill -9), writers and readers of one
// sector at once (never torn).

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// hostFS makes a small ext4 file system of size bytes, loop-mounted for the
// test, and returns its mount point.
func hostFS(t *testing.T, size string) string {
	t.Helper()
	qemu.Require(t, "mkfs.ext4", "mount", "umount")
	file := filepath.Join(t.TempDir(), "host.ext4")
	qemu.Run(t, "truncate", "-s", size, file)
	qemu.Run(t, "mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", file)
	dir := t.TempDir()
	qemu.Run(t, "mount", "-o", "loop", file, dir)
	t.Cleanup(func() {
		if out, err := exec.Command("umount", dir).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v %s", dir, err, out)
			exec.Command("umount", "-l", dir).Run()
		}
	})
	return dir
}

// freeBytes is what statfs says an unprivileged writer may still use.
func freeBytes(t *testing.T, dir string) int64 {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	return int64(st.Bavail) * st.Bsize
}

// leaveFree fills dir with a file so that about free bytes are left, and
// returns the file.
func leaveFree(t *testing.T, dir string, free int64) string {
	filler := filepath.Join(dir, "filler")
	if n := freeBytes(t, dir) - free; n > 0 {
		qemu.Run(t, "fallocate", "-l", strconv.FormatInt(n, 10), filler)
	}
	if got := freeBytes(t, dir); got < free-(1<<20) || got > free+(1<<20) {
		t.Fatalf("%d bytes free, want about %d", got, free)
	}
	return filler
}

// TestENOSPC: on a host file system with 1, 4 or 24 MiB free, the first
// 4 KiB write of a fresh image succeeds, as qemu-io's does on the same
// file system (the reservation ahead is a hint); writing on fails with
// ENOSPC, not EIO, once the host is full; after space is freed, writes go
// through again (the error did not stick); and after unmount the image
// keeps no space reserved past its clusters, qemu-img check finds it clean
// and every write acknowledged by fsync reads back.
func TestENOSPC(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "qemu-img", "qemu-io", "fallocate")
	for _, freeMiB := range []int64{1, 4, 24} {
		t.Run(fmt.Sprintf("%dMiB", freeMiB), func(t *testing.T) {
			host := hostFS(t, "96M")
			src := filepath.Join(host, "images")
			os.Mkdir(src, 0o755)
			img := filepath.Join(src, "fresh.qcow2")
			qemu.Create(t, "qcow2", img, "64M")
			peer := filepath.Join(host, "peer.qcow2")
			qemu.Create(t, "qcow2", peer, "64M")
			filler := leaveFree(t, host, freeMiB<<20)

			// qemu's own writer succeeds here.
			qemu.IO(t, peer, "write -P 0x33 0 4k")

			m := harness.Mount(t, src, "--writable")
			raw := filepath.Join(m.Dir, "fresh.raw")
			f := harness.OpenFile(t, raw, os.O_RDWR|unix.O_DIRECT)
			buf := harness.AlignedBlock(t, 1<<20)
			model := make([]byte, 64<<20)
			write := func(off int64, n int, fill byte) error {
				for i := range buf[:n] {
					buf[i] = fill
				}
				if _, err := f.WriteAt(buf[:n], off); err != nil {
					return err
				}
				return f.Sync()
			}
			if err := write(0, 4096, 0x44); err != nil {
				t.Fatalf("the first 4 KiB write with %d MiB free: %v", freeMiB, err)
			}
			copy(model, buf[:4096])
			// Fill the host: 1 MiB writes until one fails; it must be
			// ENOSPC.
			var off int64 = 1 << 20
			var werr error
			for ; off < 64<<20; off += 1 << 20 {
				if werr = write(off, 1<<20, byte(off>>20)); werr != nil {
					break
				}
				copy(model[off:], buf[:1<<20])
			}
			if !errors.Is(werr, unix.ENOSPC) {
				t.Fatalf("writing until the host is full: %v at %d, want ENOSPC", werr, off)
			}
			// Space comes back: so do writes.
			if err := os.Remove(filler); err != nil {
				t.Fatal(err)
			}
			if err := write(off, 1<<20, 0x77); err != nil {
				t.Fatalf("a write after space was freed: %v (the ENOSPC stuck)", err)
			}
			copy(model[off:], buf[:1<<20])
			f.Close()
			m.Unmount(t)

			qemu.Img(t, "check", img)
			out := string(qemu.Img(t, "check", "--output=json", img))
			var end int64
			if i := strings.Index(out, `"image-end-offset": `); i >= 0 {
				fmt.Sscan(out[i+len(`"image-end-offset": `):], &end)
			}
			st, err := os.Stat(img)
			if err != nil {
				t.Fatal(err)
			}
			if end == 0 || st.Size() > end {
				t.Errorf("after unmount the image file has %d bytes, its clusters end at %d: space is still reserved", st.Size(), end)
			}
			modelFile := filepath.Join(t.TempDir(), "model.raw")
			if err := os.WriteFile(modelFile, model, 0o644); err != nil {
				t.Fatal(err)
			}
			qemu.Img(t, "compare", "-f", "qcow2", "-F", "raw", img, modelFile)
		})
	}
}

// The kill -9 test: a writer writes sequence-numbered, checksummed 4 KiB
// records at pseudo-random offsets through a writable mount, fsyncs every
// few records and logs the last sequence number acknowledged, durably,
// outside the mount; the daemon is killed with SIGKILL at a random moment.
// Then qemu-img check must find no corruption, every acknowledged record
// must read back (or a later one for its offset), and the image must mount
// and write again.

const (
	killRecord = 4096
	killSpan   = 256 << 20 // records land in the first 256 MiB
)

// killRecordAt makes record seq for offset off: seq, offset, payload,
// crc32 of the rest at the end.
func killRecordAt(seq uint64, off int64) []byte {
	b := make([]byte, killRecord)
	binary.BigEndian.PutUint64(b, seq)
	binary.BigEndian.PutUint64(b[8:], uint64(off))
	r := rand.New(rand.NewPCG(seq, uint64(off)))
	for i := 16; i < killRecord-4; i++ {
		b[i] = byte(r.Uint32())
	}
	binary.BigEndian.PutUint32(b[killRecord-4:], crc32.ChecksumIEEE(b[:killRecord-4]))
	return b
}

// killParse decodes a record, ok false if it is not one (zeros, or torn).
func killParse(b []byte) (seq uint64, off int64, ok bool) {
	if crc32.ChecksumIEEE(b[:killRecord-4]) != binary.BigEndian.Uint32(b[killRecord-4:]) {
		return 0, 0, false
	}
	return binary.BigEndian.Uint64(b), int64(binary.BigEndian.Uint64(b[8:])), true
}

// killOffset is where record seq goes (offsets repeat, so later records
// overwrite earlier ones).
func killOffset(seed, seq uint64) int64 {
	r := rand.New(rand.NewPCG(seed, seq))
	return r.Int64N(killSpan/killRecord/8) * killRecord // 8192 slots: many rewrites
}

func TestKillDaemonUnderLoad(t *testing.T) {
	killRounds(t, 20, 42, func(t *testing.T, img string) killImage {
		qemu.Create(t, "qcow2", img, "1G")
		return killImage{path: img}
	})
}

// TestKillEncrypted is the kill -9 test on a LUKS-encrypted image
// (AES-256-XTS), its key in --key-file: after each kill qemu-img check
// with the secret finds no corruption, qemu-img convert with it reads
// every acknowledged record, and the image mounts and writes again.
func TestKillEncrypted(t *testing.T) {
	killRounds(t, 6, 35, func(t *testing.T, img string) killImage {
		qemu.CreateLUKS(t, img, "kill -9 pass", "1G", "")
		key := filepath.Join(t.TempDir(), "key")
		os.WriteFile(key, []byte("kill -9 pass"), 0o600)
		e := qemu.EncImage{Name: "vm", Path: img, Secrets: map[string]string{"vm.qcow2": "kill -9 pass"}, Chain: []string{"vm.qcow2"}}
		return killImage{path: img, enc: &e, args: []string{"--key-file", key}}
	})
}

// killRounds runs rounds kill rounds (killRound), each on a fresh 1 GiB
// image vm.qcow2 that mk makes at img, its offsets drawn from seed.
func killRounds(t *testing.T, rounds int, seed uint64, mk func(t *testing.T, img string) killImage) {
	harness.RequireFUSE(t)
	r := rand.New(rand.NewPCG(seed, seed))
	for round := range rounds {
		t.Run(fmt.Sprint(round), func(t *testing.T) {
			killRound(t, r, round, mk(t, filepath.Join(qemu.TempDir(t), "vm.qcow2")))
		})
	}
}

// killImage is the image a kill round writes: a plain one, or an
// encrypted one (enc) with the mount flags that give its key.
type killImage struct {
	path string
	enc  *qemu.EncImage
	args []string
}

// check runs qemu-img check on the image (with its secret).
func (k killImage) check(t *testing.T) harness.Result {
	if k.enc != nil {
		return harness.Exec(t, "qemu-img", k.enc.Args(t, "check")...)
	}
	return harness.Exec(t, "qemu-img", "check", k.path)
}

// toRaw converts the image with qemu-img convert (with its secret).
func (k killImage) toRaw(t *testing.T, raw string) string {
	if k.enc != nil {
		return k.enc.ToRaw(t, raw)
	}
	return qemu.ToRaw(t, k.path, raw)
}

// killRound writes records through a writable mount of the image's
// folder, kills the daemon at a random moment, and checks the image.
func killRound(t *testing.T, r *rand.Rand, round int, k killImage) {
	src := filepath.Dir(k.path)
	// Every other round without the kernel's writeback cache
	// (the default has it): fsync must be exact either way.
	args := append([]string{"--writable"}, k.args...)
	if round%2 == 1 {
		args = append(args, "--no-writeback-cache")
	}
	m := harness.Mount(t, src, args...)
	daemon := harness.DaemonOf(t, m.Dir)
	ackLog := filepath.Join(t.TempDir(), "acked")
	seed := uint64(round)
	// The writer runs as its own process: this test's.
	f := harness.OpenFile(t, filepath.Join(m.Dir, "vm.raw"), os.O_RDWR)
	ack, err := os.OpenFile(ackLog, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	every := 1 + r.IntN(16)
	done := make(chan uint64, 1)
	go func() {
		var acked uint64
		defer func() { done <- acked }()
		for seq := uint64(1); ; seq++ {
			off := killOffset(seed, seq)
			if _, err := f.WriteAt(killRecordAt(seq, off), off); err != nil {
				return
			}
			if seq%uint64(every) == 0 {
				if err := f.Sync(); err != nil {
					return
				}
				acked = seq
				fmt.Fprintf(ack, "%d\n", seq)
				ack.Sync()
			}
		}
	}()
	acked := killAfter(t, m, daemon, time.Duration(50+r.IntN(700))*time.Millisecond, done)
	f.Close()
	ack.Close()
	harness.WaitGone(t, m.Dir)
	exec.Command("fusermount3", "-uz", m.Dir).Run()

	// No corruption.
	check := k.check(t)
	if check.Code != 0 && check.Code != 3 {
		t.Fatalf("qemu-img check after kill -9 (exit %d):\n%s%s", check.Code, check.Stdout, check.Stderr)
	}
	// Every acknowledged record, or a later one for its offset. (Only
	// the records are read from the 1 GiB raw disk qemu made.)
	raw, err := os.Open(k.toRaw(t, filepath.Join(t.TempDir(), "after.raw")))
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	lastAcked := map[int64]uint64{}
	for seq := uint64(1); seq <= acked; seq++ {
		lastAcked[killOffset(seed, seq)] = seq
	}
	rec := make([]byte, killRecord)
	for off, want := range lastAcked {
		if _, err := raw.ReadAt(rec, off); err != nil {
			t.Fatal(err)
		}
		seq, at, ok := killParse(rec)
		if !ok || at != off || seq < want {
			t.Fatalf("after kill -9 (acked %d): offset %d holds %v (seq %d, offset %d); want record %d or a later one for it",
				acked, off, ok, seq, at, want)
		}
		if !bytes.Equal(rec, killRecordAt(seq, off)) {
			t.Fatalf("offset %d: record %d is not what was written", off, seq)
		}
	}
	t.Logf("round %d (%v): fsync every %d, %d records acknowledged, qemu-img check exit %d", round, args, every, acked, check.Code)

	writesAgain(t, src, k.args, k.check)
}

// killAfter kills the daemon with SIGKILL after d (the fault injected at
// a random moment, not a wait for anything) and returns what the writer
// sends on done once it notices.
func killAfter[T any](t *testing.T, m *harness.Mounted, daemon int, d time.Duration, done <-chan T) T {
	time.Sleep(d)
	unix.Kill(daemon, unix.SIGKILL)
	select {
	case v := <-done:
		return v
	case <-time.After(30 * time.Second):
		t.Fatal("the writer did not notice the daemon was gone")
		panic("unreachable")
	}
}

// writesAgain checks that the image in src, after a kill, mounts writable
// again (with args), takes a write and an fsync, and passes check (leaks
// allowed) after the unmount.
func writesAgain(t *testing.T, src string, args []string, check func(*testing.T) harness.Result) {
	m2 := harness.Mount(t, src, append([]string{"--writable"}, args...)...)
	g := harness.OpenFile(t, filepath.Join(m2.Dir, "vm.raw"), os.O_RDWR)
	if _, err := g.WriteAt(killRecordAt(1<<40, 0), 0); err != nil {
		t.Fatal(err)
	}
	if err := g.Sync(); err != nil {
		t.Fatal(err)
	}
	g.Close()
	m2.Unmount(t)
	harness.WaitGone(t, m2.Dir) // (its locks go with it)
	if c := check(t); c.Code != 0 && c.Code != 3 {
		t.Fatalf("qemu-img check after mounting again (exit %d):\n%s%s", c.Code, c.Stdout, c.Stderr)
	}
}

// TestSectorsNeverTorn: a disk never tears a 512-byte sector, so neither
// may qcowfs. Two O_DIRECT writers rewrite the same 64 KiB of an image with
// 512 B clusters (every cluster allocated, so every write is in place),
// each write filling every sector with one byte value, while two O_DIRECT
// readers read the range over and over: every sector a reader gets is one
// value, whole. With the writeback cache off, so that every write and read
// crosses FUSE.
func TestSectorsNeverTorn(t *testing.T) {
	harness.RequireFUSE(t)
	src := t.TempDir()
	img := filepath.Join(src, "torn.qcow2")
	qemu.Create(t, "qcow2", img, "1M", "-o", "cluster_size=512")
	qemu.IO(t, img, "write -P 0x1 0 1M")
	m := harness.Racy.Mount(t, src, "--writable", "--no-writeback-cache")
	raw := filepath.Join(m.Dir, "torn.raw")
	const span = 64 << 10
	deadline := time.Now().Add(3 * time.Second)
	var torn atomic.Int64
	var first atomic.Value
	var reads, writes atomic.Int64
	var wg sync.WaitGroup
	run := func(write bool, id int) {
		defer wg.Done()
		f, err := os.OpenFile(raw, os.O_RDWR|unix.O_DIRECT, 0)
		if err != nil {
			first.CompareAndSwap(nil, err.Error())
			torn.Add(1)
			return
		}
		defer f.Close()
		buf := harness.AlignedBlock(t, span)
		for n := 0; time.Now().Before(deadline); n++ {
			if write {
				v := byte(2 + (n*2+id)%250)
				for i := range buf {
					buf[i] = v
				}
				if _, err := f.WriteAt(buf, 0); err != nil {
					first.CompareAndSwap(nil, err.Error())
					torn.Add(1)
					return
				}
				writes.Add(1)
				continue
			}
			if _, err := f.ReadAt(buf, 0); err != nil {
				first.CompareAndSwap(nil, err.Error())
				torn.Add(1)
				return
			}
			reads.Add(1)
			for s := 0; s < span; s += 512 {
				for i := s + 1; i < s+512; i++ {
					if buf[i] != buf[s] {
						first.CompareAndSwap(nil, fmt.Sprintf("sector %d torn: byte %d is %#x, byte %d is %#x", s/512, s, buf[s], i, buf[i]))
						torn.Add(1)
						break
					}
				}
			}
		}
	}
	for id := range 2 {
		wg.Add(2)
		go run(true, id)
		go run(false, id)
	}
	wg.Wait()
	if torn.Load() > 0 {
		t.Fatalf("%d torn sectors or errors in %d reads and %d writes; the first: %v", torn.Load(), reads.Load(), writes.Load(), first.Load())
	}
	t.Logf("%d reads, %d writes, no sector torn", reads.Load(), writes.Load())
}
