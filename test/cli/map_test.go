package cli

import (
	"reflect"
	"strings"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestMapCommand compares `qcowfs map` with `qemu-img map`, JSON and
// human output, on the status matrix (the image's pages dropped from the
// page cache first: harness.Both). The only difference allowed: the
// JSON entries carry "compressed" (as qemu 8 and later print it), which
// qemu 7.2 omits; it is compared when qemu prints it.
func TestMapCommand(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	dir := qemu.TempDir(t)
	for _, im := range qemu.StatusMatrix(t, dir) {
		t.Run(im.Name, func(t *testing.T) {
			q, us := harness.Both(t, dir, "map", "--output=json", im.Path)
			harness.WantOK(t, "qemu-img map --output=json", q)
			harness.WantOK(t, "qcowfs map --output=json", us)
			var got, want []qemu.MapEntry
			us.JSON(t, &got)
			q.JSON(t, &want)
			for i := range got {
				if i < len(want) && want[i].Compressed == nil {
					got[i].Compressed = nil
				}
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("qcowfs map --output=json differs from qemu-img map")
			}

			q, us = harness.Both(t, dir, "map", im.Path)
			if q.Code != 0 {
				// qemu-img refuses to print compressed images in
				// human form; so do we.
				if us.Code == 0 || !strings.Contains(q.Stderr, "compressed") {
					t.Errorf("qemu-img map failed (exit %d: %s), qcowfs map exits %d", q.Code, q.Stderr, us.Code)
				}
				return
			}
			if us.Code != 0 || us.Stdout != q.Stdout {
				t.Errorf("qcowfs map differs from qemu-img map:\n%s%s\nqemu-img:\n%s", us.Stdout, us.Stderr, q.Stdout)
			}
		})
	}
}
