package test

import (
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"

	"github.com/qcowfs/qcowfs/test/qemu"
)

// checkJSON runs a checker (qemu-img or qcowfs) with --output=json and
// returns its decoded output and exit status.
func checkJSON(t *testing.T, name string, args ...string) (map[string]any, int) {
	t.Helper()
	cmd := exec.Command(name, append([]string{"check", "--output=json"}, args...)...)
	out, err := cmd.Output()
	var m map[string]any
	if jerr := json.Unmarshal(out, &m); jerr != nil {
		t.Fatalf("%s check %v: %v; output %q", name, args, err, out)
	}
	return m, exitCode(err)
}

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
			want, wantCode := checkJSON(t, "qemu-img", im.Path)
			got, gotCode := checkJSON(t, qcowfsBin, im.Path)
			if !reflect.DeepEqual(got, want) || gotCode != wantCode {
				t.Errorf("qcowfs check (exit %d):\n%v\nqemu-img check (exit %d):\n%v", gotCode, got, wantCode, want)
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
	requireFUSE(t)
	src := qemu.TempDir(t)
	const cs = 65536
	for _, im := range qemu.Damaged(t, src) {
		t.Run(im.Name, func(t *testing.T) {
			if c := cliRunCmd(t, exec.Command("qemu-img", "check", im.Path)); c.code == 0 {
				t.Fatalf("qemu-img check finds nothing wrong with %s: %s", im.Name, c.stdout)
			}
			for _, out := range []string{"human", "json"} {
				args := []string{"check", "--output=" + out, im.Path}
				q, us := cliBoth(t, src, args...)
				cliSameAsQemu(t, strings.Join(args, " "), q, us)
			}
		})
	}
	m := mountImages(t, src, "--allow-corrupt")
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
