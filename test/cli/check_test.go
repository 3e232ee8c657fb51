package cli

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// checkImages is the matrix plus images the check must cover: snapshots
// (in the matrix), persistent bitmaps with dirty bits, compressed
// clusters, extended L2, external data files.
func checkImages(t *testing.T, dir string) []qemu.Image {
	images := qemu.StatusMatrix(t, dir)
	bm := filepath.Join(dir, "bitmaps.qcow2")
	qemu.Create(t, "qcow2", bm, "16M")
	qemu.Img(t, "bitmap", "--add", bm, "bm0")
	qemu.Img(t, "bitmap", "--add", "-g", "512k", bm, "bm1")
	qemu.IO(t, bm, "write -P 0x42 0 3M", "write -P 0x43 10M 64k")
	return append(images, qemu.Image{Name: "bitmaps", Path: bm})
}

// TestCheckMatchesQemu: on every clean image, qcowfs check prints what
// qemu-img check prints (JSON, every field) and exits the same way.
func TestCheckMatchesQemu(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	dir := qemu.TempDir(t)
	for _, im := range checkImages(t, dir) {
		t.Run(im.Name, func(t *testing.T) {
			q, us := harness.Both(t, dir, "check", "--output=json", im.Path)
			var want, got map[string]any
			q.JSON(t, &want)
			us.JSON(t, &got)
			if !reflect.DeepEqual(got, want) || us.Code != q.Code {
				t.Errorf("qcowfs check (exit %d):\n%v\nqemu-img check (exit %d):\n%v", us.Code, got, q.Code, want)
			}
		})
	}
}

// TestCheckDamaged damages images on purpose (qemu.Damaged); qcowfs check
// must find each problem as qemu-img check does: the same lines on stderr
// (qemu's messages, word for word), the same summary and JSON, the same
// exit status. Reading the damaged range through the mount must fail with
// EIO where it would otherwise hand out metadata.
func TestCheckDamaged(t *testing.T) {
	harness.RequireFUSE(t)
	src := qemu.TempDir(t)
	const cs = 65536
	for _, im := range qemu.Damaged(t, src) {
		t.Run(im.Name, func(t *testing.T) {
			if c := harness.RunCmd(t, exec.Command("qemu-img", "check", im.Path)); c.Code == 0 {
				t.Fatalf("qemu-img check finds nothing wrong with %s: %s", im.Name, c.Stdout)
			}
			for _, out := range []string{"human", "json"} {
				args := []string{"check", "--output=" + out, im.Path}
				q, us := harness.Both(t, src, args...)
				harness.SameAsQemu(t, strings.Join(args, " "), q, us)
			}
		})
	}
	m := harness.Mount(t, src, "--allow-corrupt")
	// Cluster 2 of l2-into-l1 points into the L1 table: reading it must
	// fail rather than return the table's bytes as guest data.
	f, err := os.Open(filepath.Join(m.Dir, "l2-into-l1.raw"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.ReadAt(make([]byte, 4096), 2*cs); !errors.Is(err, syscall.EIO) {
		t.Errorf("reading guest data that points into the L1 table: %v, want EIO", err)
	}
	if _, err := f.ReadAt(make([]byte, 4096), 0); err != nil {
		t.Errorf("reading intact data of the damaged image: %v", err)
	}
}
