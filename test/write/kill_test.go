package write

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

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
	harness.RequireFUSE(t)
	const rounds = 20
	r := rand.New(rand.NewPCG(42, 42))
	for round := 0; round < rounds; round++ {
		t.Run(fmt.Sprint(round), func(t *testing.T) {
			src := qemu.TempDir(t)
			img := filepath.Join(src, "vm.qcow2")
			qemu.Create(t, "qcow2", img, "1G")
			killRound(t, r, round, killImage{path: img})
		})
	}
}

// TestKillEncrypted is the kill -9 test on a LUKS-encrypted image
// (AES-256-XTS), its key in --key-file: after each kill qemu-img check
// with the secret finds no corruption, qemu-img convert with it reads
// every acknowledged record, and the image mounts and writes again.
func TestKillEncrypted(t *testing.T) {
	harness.RequireFUSE(t)
	const rounds = 6
	r := rand.New(rand.NewPCG(35, 35))
	for round := 0; round < rounds; round++ {
		t.Run(fmt.Sprint(round), func(t *testing.T) {
			src := qemu.TempDir(t)
			img := filepath.Join(src, "vm.qcow2")
			qemu.CreateLUKS(t, img, "kill -9 pass", "1G", "")
			key := filepath.Join(t.TempDir(), "key")
			os.WriteFile(key, []byte("kill -9 pass"), 0o600)
			e := qemu.EncImage{Name: "vm", Path: img, Secrets: map[string]string{"vm.qcow2": "kill -9 pass"}, Chain: []string{"vm.qcow2"}}
			killRound(t, r, round, killImage{path: img, enc: &e, args: []string{"--key-file", key}})
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
		return harness.RunCmd(t, exec.Command("qemu-img", k.enc.Args(t, "check")...))
	}
	return harness.RunCmd(t, exec.Command("qemu-img", "check", k.path))
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
	daemons := harness.Daemons(t, m.Dir)
	if len(daemons) != 1 {
		t.Fatalf("want one daemon, have %v", daemons)
	}
	ackLog := filepath.Join(t.TempDir(), "acked")
	seed := uint64(round)
	// The writer runs as its own process: this test's.
	f, err := os.OpenFile(filepath.Join(m.Dir, "vm.raw"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
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
	// The kill comes at a random moment (this is the fault
	// injected, not a wait for anything).
	time.Sleep(time.Duration(50+r.IntN(700)) * time.Millisecond)
	syscall.Kill(daemons[0], syscall.SIGKILL)
	var acked uint64
	select {
	case acked = <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the writer did not notice the daemon was gone")
	}
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

	// It mounts and writes again.
	m2 := harness.Mount(t, src, append([]string{"--writable"}, k.args...)...)
	g, err := os.OpenFile(filepath.Join(m2.Dir, "vm.raw"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := g.WriteAt(killRecordAt(1<<40, 0), 0); err != nil {
		t.Fatal(err)
	}
	if err := g.Sync(); err != nil {
		t.Fatal(err)
	}
	g.Close()
	m2.Unmount(t)
	harness.WaitGone(t, m2.Dir) // (its locks go with it)
	check = k.check(t)
	if check.Code != 0 && check.Code != 3 {
		t.Fatalf("qemu-img check after mounting again (exit %d):\n%s%s", check.Code, check.Stdout, check.Stderr)
	}
}
