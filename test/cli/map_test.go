package test

import (
	"encoding/json"
	"os/exec"
	"reflect"
	"strings"
	"testing"

	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestMapCommand compares `qcowfs map` with `qemu-img map`, JSON and
// human output, on the status matrix. The only difference allowed: the
// JSON entries carry "compressed" (as qemu 8 and later print it), which
// qemu 7.2 omits; it is compared when qemu prints it.
func TestMapCommand(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	dir := qemu.TempDir(t)
	for _, im := range qemu.StatusMatrix(t, dir) {
		t.Run(im.Name, func(t *testing.T) {
			out, err := qcowfs("map", "--output=json", im.Path)
			if err != nil {
				t.Fatalf("qcowfs map: %v\n%s", err, out)
			}
			var got []qemu.MapEntry
			if err := json.Unmarshal([]byte(out), &got); err != nil {
				t.Fatalf("qcowfs map --output=json is not JSON: %v\n%s", err, out)
			}
			want := qemu.Map(t, im.Path)
			for i := range got {
				if i < len(want) && want[i].Compressed == nil {
					got[i].Compressed = nil
				}
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("qcowfs map --output=json differs from qemu-img map")
			}

			qout, qerr := exec.Command("qemu-img", "map", im.Path).CombinedOutput()
			hout, herr := qcowfs("map", im.Path)
			if qerr != nil {
				// qemu-img refuses to print compressed images in
				// human form; so do we.
				if herr == nil || !strings.Contains(string(qout), "compressed") {
					t.Errorf("qemu-img map failed (%v: %s), qcowfs map: %v", qerr, qout, herr)
				}
				return
			}
			if herr != nil || hout != string(qout) {
				t.Errorf("qcowfs map differs from qemu-img map:\n%s\nqemu-img:\n%s", hout, qout)
			}
		})
	}
}
