package qcow2

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestDataBytesBudget: a count that needs more work than it is given
// fails with ErrWalkBudget (the caller keeps its estimate); with enough it
// is exact, against qemu-img map.
func TestDataBytesBudget(t *testing.T) {
	p := filepath.Join(t.TempDir(), "frag.qcow2")
	qemu.Create(t, "qcow2", p, "64M", "-o", "cluster_size=4096")
	var cmds []string
	for off := 0; off < 32<<20; off += 8192 {
		cmds = append(cmds, fmt.Sprintf("write -P 1 %d 4k", off))
	}
	qemu.IO(t, p, cmds...)
	var want int64
	for _, e := range qemu.Map(t, p) {
		if !e.Zero {
			want += e.Length
		}
	}
	img, err := Open(p, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	if _, err := img.dataBytes(context.Background(), 0, img.Size(), 1000); !errors.Is(err, ErrWalkBudget) {
		t.Errorf("a count with 1,000 units of work for 4,096 extents: %v, want ErrWalkBudget", err)
	}
	if n, err := img.dataBytes(context.Background(), 0, img.Size(), CountWork); err != nil || n != want {
		t.Errorf("DataBytes = %d, %v; qemu-img map says %d", n, err, want)
	}
}
