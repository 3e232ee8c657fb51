package qcow2_test

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestHostRangesSuffice: images qemu wrote, with data, zero clusters,
// compressed clusters, clusters freed by a discard, an internal snapshot,
// subclusters and a qcow2 and a raw backing file. Every byte of each file
// of the chain outside HostRanges is overwritten (a copy of each, the
// same names): qemu-img convert of the scrubbed chain equals qemu-img
// convert of the original, so the ranges are all a reader needs. The
// clusters the discard freed are not among them, so they are not more.
func TestHostRangesSuffice(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	for _, tc := range []struct {
		name    string
		opts    []string
		backing string // "", "qcow2" or "raw"
	}{
		{"plain", nil, ""},
		{"small clusters", []string{"-o", "cluster_size=4096"}, ""},
		{"extended L2", []string{"-o", "extended_l2=on"}, ""},
		{"over qcow2", nil, "qcow2"},
		{"over raw", []string{"-o", "cluster_size=16384"}, "raw"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := qemu.TempDir(t)
			var args []string
			switch tc.backing {
			case "qcow2":
				base := filepath.Join(dir, "base.qcow2")
				qemu.Create(t, "qcow2", base, "32M")
				qemu.IO(t, base, "write -P 0x21 0 3M", "write -P 0x22 20M 1M", "write -c -P 0x23 30M 64k")
				args = []string{"-b", "base.qcow2", "-F", "qcow2"}
			case "raw":
				base := filepath.Join(dir, "base.raw")
				qemu.Create(t, "raw", base, "32M")
				qemu.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x31 1M 2M", "-c", "write -P 0x32 25M 1M", base)
				args = []string{"-b", "base.raw", "-F", "raw"}
			}
			top := filepath.Join(dir, "top.qcow2")
			qemu.Create(t, "qcow2", top, "32M", append(append([]string{}, tc.opts...), args...)...)
			qemu.IO(t, top, "write -P 0x41 512k 1M", "write -P 0x42 8M 2M", "write -z 2M 128k",
				"write -c -P 0x43 12M 256k", "write -P 0x44 31M 17k")
			qemu.Img(t, "snapshot", "-c", "snap", top)
			qemu.IO(t, top, "write -P 0x45 16M 1M", "discard 8M 1M", "write -P 0x46 1M 4k")
			freed := hostOffsets(t, top, 16<<20, 1<<20) // written, then discarded:
			qemu.IO(t, top, "discard 16M 1M")           // freed (its snapshot never saw it)

			img, err := qcow2.Open(top, qcow2.Options{})
			if err != nil {
				t.Fatal(err)
			}
			need := map[string][]qcow2.HostRange{}
			err = img.HostRanges(context.Background(), func(r qcow2.HostRange) error {
				need[r.File.Name()] = append(need[r.File.Name()], r)
				return nil
			})
			img.Close()
			if err != nil {
				t.Fatal(err)
			}
			for _, f := range freed {
				for _, r := range need[top] {
					if r.Off < f+4096 && f < r.Off+r.Len {
						t.Errorf("HostRanges names [%d, +%d) of the top, where a discard freed the cluster at %d", r.Off, r.Len, f)
					}
				}
			}
			scrubbed := qemu.TempDir(t)
			names, _ := filepath.Glob(filepath.Join(dir, "*"))
			for _, name := range names {
				b, err := os.ReadFile(name)
				if err != nil {
					t.Fatal(err)
				}
				out := bytes.Repeat([]byte{0xa5}, len(b))
				for _, r := range need[name] {
					if r.Off < 0 || r.Off+r.Len > int64(len(b)) {
						t.Fatalf("%s: range [%d, +%d) outside the file (%d bytes)", name, r.Off, r.Len, len(b))
					}
					copy(out[r.Off:r.Off+r.Len], b[r.Off:r.Off+r.Len])
				}
				if err := os.WriteFile(filepath.Join(scrubbed, filepath.Base(name)), out, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want := readAll(t, qemu.ToRaw(t, top, filepath.Join(t.TempDir(), "want.raw")))
			got := readAll(t, qemu.ToRaw(t, filepath.Join(scrubbed, "top.qcow2"), filepath.Join(t.TempDir(), "got.raw")))
			if !bytes.Equal(got, want) {
				i := 0
				for i < len(got) && got[i] == want[i] {
					i++
				}
				t.Errorf("the chain with only HostRanges kept reads differently from byte %d", i)
			}
		})
	}
}

// hostOffsets are the host offsets, in the image file itself, of the
// clusters holding guest range [off, off+n), as qemu-img map says.
func hostOffsets(t *testing.T, path string, off, n int64) []int64 {
	t.Helper()
	var out []int64
	for _, e := range qemu.Map(t, path) {
		if e.Start+e.Length <= off || e.Start >= off+n || e.Offset == nil || e.Depth != 0 {
			continue
		}
		lo, hi := max(off, e.Start), min(off+n, e.Start+e.Length)
		for p := lo; p < hi; p += 4096 {
			out = append(out, *e.Offset+p-e.Start)
		}
	}
	if len(out) == 0 {
		t.Fatalf("qemu-img map of %s: nothing stored at [%d, +%d)", path, off, n)
	}
	return out
}
