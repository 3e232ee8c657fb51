package write

import (
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestKillWhileGrowing is issue 43's reproduction made a test: one process
// grows the raw file of a writable mount with ftruncate (mostly 3 MiB
// steps, some of one cluster or 4 KiB, some jumps that move the L1 table),
// writes a 4 KiB record at each new end and fsyncs after every third step;
// the daemon is killed with SIGKILL at a random moment 0.3 to 2.5 s in.
// Then qemu-img check finds no corruption (leaks allowed), the disk is at
// least as large as at the last acknowledged fsync, every acknowledged
// record reads back through qemu-img convert, and the image mounts and
// writes again. The rounds cycle through 512 B, 4 KiB and 64 KiB clusters,
// refcount widths 16, 64 and 1, with and without an internal snapshot,
// with and without the writeback cache. QCOWFS_GROW_KILL_ROUNDS=N runs N
// rounds (default 12: each combination of cluster size and the other
// three at least once across the rounds).
func TestKillWhileGrowing(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "qemu-img", "qemu-io")
	rounds := 12
	if s := os.Getenv("QCOWFS_GROW_KILL_ROUNDS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			t.Fatalf("QCOWFS_GROW_KILL_ROUNDS=%q", s)
		}
		rounds = n
	}
	r := rand.New(rand.NewPCG(43, 1))
	for round := range rounds {
		cs := []int64{512, 4096, 65536}[round%3]
		bits := []int{16, 64, 1}[(round/3)%3]
		snap := bits != 1 && round%2 == 0
		writeback := (round/2)%2 == 0
		name := fmt.Sprintf("%d/cluster%d-r%d-snap%v-wb%v", round, cs, bits, snap, writeback)
		t.Run(name, func(t *testing.T) {
			growKillRound(t, r, cs, bits, snap, writeback)
		})
	}
}

// growMax bounds the disk a round grows: the check converts it to raw.
const growMax = 3 << 30

func growKillRound(t *testing.T, r *rand.Rand, cs int64, bits int, snap, writeback bool) {
	src := qemu.TempDir(t)
	img := filepath.Join(src, "vm.qcow2")
	qemu.Create(t, "qcow2", img, "8M", "-o", fmt.Sprintf("cluster_size=%d,refcount_bits=%d", cs, bits))
	if snap {
		qemu.IO(t, img, "write -P 0x6e 0 1M")
		qemu.Img(t, "snapshot", "-c", "before", img)
	}
	args := []string{"--writable"}
	if !writeback {
		args = append(args, "--no-writeback-cache")
	}
	m := harness.Mount(t, src, args...)
	daemon := harness.DaemonOf(t, m.Dir)
	f := harness.OpenFile(t, filepath.Join(m.Dir, "vm.raw"), os.O_RDWR)

	// A jump moves the L1 table (a cluster of it maps cs/8 L2 tables of
	// cs/8 clusters), within growMax.
	jump := min((cs/8)*(cs/8)*cs, 1<<30)
	type ack struct {
		size int64
		recs []int64 // offsets of the acknowledged records (seq = index+1)
	}
	done := make(chan ack, 1)
	seed := r.Uint64()
	go func() {
		g := rand.New(rand.NewPCG(seed, 7))
		size := int64(8 << 20)
		var acked ack
		var recs []int64
		defer func() { done <- acked }()
		for step := 1; ; step++ {
			var d int64
			switch k := g.IntN(8); {
			case k == 0:
				d = 4096
			case k == 1:
				d = max(cs, 4096)
			case k == 2:
				d = jump
			default:
				d = 3 << 20
			}
			if size+d > growMax {
				d = 4096 // keep going without growing past what the check converts
			}
			size += d
			if err := f.Truncate(size); err != nil {
				return
			}
			off := size - killRecord
			if _, err := f.WriteAt(killRecordAt(uint64(len(recs)+1), off), off); err != nil {
				return
			}
			recs = append(recs, off)
			if step%3 == 0 {
				if err := f.Sync(); err != nil {
					return
				}
				acked = ack{size: size, recs: append([]int64(nil), recs...)}
			}
		}
	}()
	acked := killAfter(t, m, daemon, time.Duration(300+r.IntN(2200))*time.Millisecond, done)
	f.Close()
	harness.WaitGone(t, m.Dir)
	exec.Command("fusermount3", "-uz", m.Dir).Run()

	check := harness.Exec(t, "qemu-img", "check", img)
	if check.Code != 0 && check.Code != 3 {
		t.Fatalf("qemu-img check after kill -9 (%d records, %d bytes acknowledged; exit %d):\n%s%s",
			len(acked.recs), acked.size, check.Code, check.Stdout, check.Stderr)
	}
	size := int64(qemu.Info(t, img)["virtual-size"].(float64))
	if size < acked.size {
		t.Fatalf("after kill -9 the disk is %d bytes; %d were acknowledged by fsync", size, acked.size)
	}
	raw, err := os.Open(qemu.ToRaw(t, img, filepath.Join(qemu.TempDir(t), "after.raw")))
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	// A record is overwritten only by a later one that overlaps it
	// (steps of 4 KiB write the next record right after it): the last
	// acknowledged record must read back whole; earlier ones where no
	// later record overlaps them.
	rec := make([]byte, killRecord)
	for i, off := range acked.recs {
		if i+1 < len(acked.recs) && acked.recs[i+1] < off+killRecord {
			continue
		}
		if _, err := raw.ReadAt(rec, off); err != nil {
			t.Fatal(err)
		}
		seq, at, ok := killParse(rec)
		if !ok || at != off || seq != uint64(i+1) {
			t.Fatalf("after kill -9 (%d records acknowledged, disk %d bytes): offset %d holds record %v (seq %d at %d); want record %d",
				len(acked.recs), size, off, ok, seq, at, i+1)
		}
	}
	t.Logf("%d records and %d bytes acknowledged, disk %d bytes, qemu-img check exit %d", len(acked.recs), acked.size, size, check.Code)

	writesAgain(t, src, nil, func(t *testing.T) harness.Result { return harness.Exec(t, "qemu-img", "check", img) })
}
