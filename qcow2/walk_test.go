package qcow2_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// within runs f, failing the test if it does not return within d: a
// hostile image must not make a walk run away.
func within(t *testing.T, what string, d time.Duration, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s did not return within %v", what, d)
	}
}

// oneTableImage makes a 64 KiB-cluster image of l1 L2 spans (512 MiB
// each) whose every L1 entry names the first span's L2 table, written with
// cmds; it returns the image and the data runs qemu-img map reports for
// that one span (the oracle: every span of the disk reads the same).
func oneTableImage(t *testing.T, dir string, l1 int, cmds ...string) (string, [][2]int64) {
	t.Helper()
	const span = 512 << 20
	one := filepath.Join(dir, "one.qcow2")
	qemu.Create(t, "qcow2", one, "512M")
	qemu.IO(t, one, cmds...)
	var pattern [][2]int64
	for _, e := range qemu.Map(t, one) {
		if e.Data && !e.Zero {
			pattern = append(pattern, [2]int64{e.Start, e.Start + e.Length})
		}
	}
	p := filepath.Join(dir, "all-to-one.qcow2")
	qemu.Create(t, "qcow2", p, fmt.Sprint(int64(l1)*span))
	qemu.IO(t, p, cmds...)
	l1off := int64(qemu.ReadU(t, p, qemu.HeaderL1TableOffset, 8))
	e := qemu.ReadU(t, p, l1off, 8)
	buf := make([]byte, 8*l1)
	for i := 0; i < l1; i++ {
		for b := 0; b < 8; b++ {
			buf[8*i+b] = byte(e >> (56 - 8*b))
		}
	}
	qemu.WriteAt(t, p, l1off, buf)
	return p, pattern
}

// TestWalkOneL2TableEverywhere: an image whose 524,288 L1 entries all
// name one L2 table (256 TiB of disk from a few MiB of metadata). lseek
// answers come back at once and agree with the one table's map repeated;
// the data count walks the table once and is exact.
func TestWalkOneL2TableEverywhere(t *testing.T) {
	dir := t.TempDir()
	const l1 = 512 << 10
	const span = int64(512 << 20)
	p, pattern := oneTableImage(t, dir, l1, "write -P 1 0 64k", "write -P 2 1M 192k", "write -z 2M 64k", "write -c -P 3 8M 64k")
	if len(pattern) == 0 {
		t.Fatal("qemu-img map shows no data")
	}
	var warnings []string
	var mu sync.Mutex
	img, err := qcow2.Open(p, qcow2.Options{Warnf: func(f string, a ...any) {
		mu.Lock()
		warnings = append(warnings, fmt.Sprintf(f, a...))
		mu.Unlock()
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	var per int64
	for _, r := range pattern {
		per += r[1] - r[0]
	}
	within(t, "DataBytes", 60*time.Second, func() {
		n, err := img.DataBytes()
		if err != nil || n != per*l1 {
			t.Errorf("DataBytes = %d, %v; the one table holds %d bytes, named %d times: %d", n, err, per, l1, per*l1)
		}
	})
	// Far into the disk, every span reads like the first.
	for _, span0 := range []int64{0, 1, 4096, l1/2 + 7, l1 - 1} {
		base := span0 * span
		within(t, "lseek", 10*time.Second, func() {
			for _, r := range pattern {
				if d, err := img.NextData(context.Background(), base+r[0]); err != nil || d != base+r[0] {
					t.Errorf("span %d: NextData(%d) = %d, %v; want %d", span0, base+r[0], d, err, base+r[0])
				}
				if h, err := img.NextHole(context.Background(), base+r[0]); err != nil || h != base+r[1] {
					t.Errorf("span %d: NextHole(%d) = %d, %v; want %d", span0, base+r[0], h, err, base+r[1])
				}
			}
		})
	}
	if len(warnings) != 0 {
		t.Errorf("warnings: %q", warnings)
	}
}

// TestWalkBudget: where every L1 entry names one table full of zero
// clusters, SEEK_DATA from 0 has 512 TiB of holes to cross, more than one
// call's work budget. It answers within its budget: a conservative offset
// (data "here", which a reader then reads as zeros), and one warning.
func TestWalkBudget(t *testing.T) {
	dir := t.TempDir()
	p, pattern := oneTableImage(t, dir, 1<<20, "write -z 0 512M")
	if len(pattern) != 0 {
		t.Fatalf("qemu-img map shows data: %v", pattern)
	}
	var warned []string
	img, err := qcow2.Open(p, qcow2.Options{Warnf: func(f string, a ...any) { warned = append(warned, fmt.Sprintf(f, a...)) }})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	within(t, "NextData", 30*time.Second, func() {
		d, err := img.NextData(context.Background(), 0)
		if err != nil || d < 0 || d >= img.Size() {
			t.Errorf("NextData(0) = %d, %v; want a conservative offset inside the disk", d, err)
		}
		if len(warned) != 1 {
			t.Errorf("a conservative answer with %d warnings: %q", len(warned), warned)
		}
		// A second one is not logged again.
		img.NextData(context.Background(), 0)
		if len(warned) != 1 {
			t.Errorf("%d warnings after two walks: %q", len(warned), warned)
		}
	})
	within(t, "NextHole", 10*time.Second, func() {
		if h, err := img.NextHole(context.Background(), 0); err != nil || h != 0 {
			t.Errorf("NextHole(0) = %d, %v; all zeros", h, err)
		}
	})
	// A context that is done stops the walk.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := img.DataBytesIn(ctx, 0, img.Size()); !errors.Is(err, context.Canceled) {
		t.Errorf("DataBytesIn with a cancelled context: %v", err)
	}
	if err := img.Map(ctx, func(qcow2.MapEntry) error { return nil }); !errors.Is(err, context.Canceled) {
		t.Errorf("Map with a cancelled context: %v", err)
	}
	if _, err := img.Check(ctx, nil); !errors.Is(err, context.Canceled) {
		t.Errorf("Check with a cancelled context: %v", err)
	}
}

// TestWalkSparseL1: a 256 TiB disk whose only L2 table is named by the
// last L1 entry: SEEK_DATA from 0 goes straight there.
func TestWalkSparseL1(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "sparse.qcow2")
	qemu.Create(t, "qcow2", p, "256T")
	last := int64(256<<40) - 64<<10
	qemu.IO(t, p, fmt.Sprintf("write -P 7 %d 64k", last))
	img, err := qcow2.Open(p, qcow2.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	within(t, "NextData", 10*time.Second, func() {
		if d, err := img.NextData(context.Background(), 0); err != nil || d != last {
			t.Errorf("NextData(0) = %d, %v; qemu-io wrote at %d", d, err, last)
		}
		if n, err := img.DataBytes(); err != nil || n != 64<<10 {
			t.Errorf("DataBytes = %d, %v", n, err)
		}
	})
}

// TestPreallocProbeSparseFile: a 512-byte-cluster image whose file is
// extended sparsely to 15 TiB. The probe for preallocated metadata looks
// at refcount blocks, not at the 33 billion clusters of the file; block
// status agrees with qemu-img map on the file before it was extended.
func TestPreallocProbeSparseFile(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "p.qcow2")
	qemu.Create(t, "qcow2", p, "64M", "-o", "cluster_size=512")
	qemu.IO(t, p, "write -P 9 0 1M", "write -P 8 8M 64k")
	want := qemu.Map(t, p)
	if err := os.Truncate(p, 15<<40); err != nil {
		t.Skipf("cannot extend a file to 15 TiB here: %v", err)
	}
	img, err := qcow2.Open(p, qcow2.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	within(t, "Map", 30*time.Second, func() {
		var got []string
		img.Map(context.Background(), func(e qcow2.MapEntry) error {
			got = append(got, fmt.Sprintf("%d+%d %v %v", e.Start, e.Length, e.Data, e.Zero))
			return nil
		})
		var w []string
		for _, e := range want {
			w = append(w, fmt.Sprintf("%d+%d %v %v", e.Start, e.Length, e.Data, e.Zero))
		}
		if strings.Join(got, "\n") != strings.Join(w, "\n") {
			t.Errorf("map:\n%s\nqemu-img map before the extension:\n%s", strings.Join(got, "\n"), strings.Join(w, "\n"))
		}
	})
	within(t, "Check", 60*time.Second, func() {
		res, err := img.Check(context.Background(), nil)
		if err != nil || res.Corruptions != 0 || res.Leaks != 0 {
			t.Errorf("Check: %+v, %v", res, err)
		}
	})
}
