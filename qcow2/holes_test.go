package qcow2_test

import (
	"context"
	"encoding/json"
	"errors"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestMapMatchesQemu compares Map with qemu-img map --output=json.
func TestMapMatchesQemu(t *testing.T) {
	dir := qemu.TempDir(t)
	for _, im := range qemu.StatusMatrix(t, dir) {
		t.Run(im.Name, func(t *testing.T) {
			want := qemu.Map(t, im.Path)
			img, err := qcow2.Open(im.Path, qcow2.Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer img.Close()
			var got []qemu.MapEntry
			err = img.Map(context.Background(), func(e qcow2.MapEntry) error {
				b, _ := json.Marshal(e)
				var m qemu.MapEntry
				json.Unmarshal(b, &m)
				got = append(got, m)
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			for i := range want {
				// qemu 7.2 does not print "compressed"; later
				// versions do. Compare it when qemu gives it.
				if want[i].Compressed == nil && i < len(got) {
					got[i].Compressed = nil
				}
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("Map differs from qemu-img map:\n got %s\nwant %s", dump(got), dump(want))
			}
		})
	}
}

func dump(m []qemu.MapEntry) string {
	b, _ := json.MarshalIndent(m, "", " ")
	return string(b)
}

// dataRuns walks the disk with NextData/NextHole, like cp does.
func dataRuns(t *testing.T, img *qcow2.Image) [][2]int64 {
	var runs [][2]int64
	for off := int64(0); off < img.Size(); {
		d, err := img.NextData(context.Background(), off)
		if errors.Is(err, qcow2.ErrNoData) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		h, err := img.NextHole(context.Background(), d)
		if err != nil {
			t.Fatal(err)
		}
		if h <= d {
			t.Fatalf("NextHole(%d) = %d after NextData(%d) = %d", d, h, off, d)
		}
		runs = append(runs, [2]int64{d, h})
		off = h
	}
	return runs
}

// TestHolesMatchQemu checks the NextData/NextHole walk of every image
// against qemu-img map (and the host files' own holes), and that every
// hole reads as zeros in qemu-img convert's output.
func TestHolesMatchQemu(t *testing.T) {
	dir := qemu.TempDir(t)
	for _, im := range qemu.StatusMatrix(t, dir) {
		t.Run(im.Name, func(t *testing.T) {
			img, err := qcow2.Open(im.Path, qcow2.Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer img.Close()
			runs := dataRuns(t, img)
			qemu.CheckHoles(t, im.Path, runs)

			var sum int64
			for _, r := range runs {
				sum += r[1] - r[0]
			}
			if n, err := img.DataBytes(); err != nil || n != sum {
				t.Errorf("DataBytes = %d, %v; the walk found %d", n, err, sum)
			}
			// A second walk is served from the index: no new host calls.
			calls := img.Stats().HoleProbes
			if again := dataRuns(t, img); !reflect.DeepEqual(again, runs) || img.Stats().HoleProbes != calls {
				t.Errorf("second walk differs or asked the host again (%d -> %d calls)", calls, img.Stats().HoleProbes)
			}
		})
	}
}

// TestSeekEdges: offsets at the start, in the last partial cluster, at and
// past the end, and on a disk without data.
func TestSeekEdges(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "odd.qcow2")
	qemu.Create(t, "qcow2", p, "10000000") // not a multiple of 64 KiB
	qemu.IO(t, p, "write -P 7 9960000 40000")
	e := filepath.Join(dir, "empty.qcow2")
	qemu.Create(t, "qcow2", e, "1M")
	// Where qemu says the data is: the oracle for the expectations below.
	var dataStart int64 = -1
	for _, m := range qemu.Map(t, p) {
		if m.Data && dataStart < 0 {
			dataStart = m.Start
		}
	}
	img, err := qcow2.Open(p, qcow2.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	size := img.Size()
	nextData := func(off int64) (int64, error) { return img.NextData(context.Background(), off) }
	nextHole := func(off int64) (int64, error) { return img.NextHole(context.Background(), off) }
	for _, tc := range []struct {
		name string
		f    func(int64) (int64, error)
		off  int64
		want int64
		err  error
	}{
		{"data from 0", nextData, 0, dataStart, nil},
		{"hole at 0", nextHole, 0, 0, nil},
		{"data in the last cluster", nextData, size - 1, size - 1, nil},
		{"hole from the last byte", nextHole, size - 1, size, nil},
		{"data at the end", nextData, size, 0, qcow2.ErrNoData},
		{"data past the end", nextData, size + 12345, 0, qcow2.ErrNoData},
	} {
		got, err := tc.f(tc.off)
		if !errors.Is(err, tc.err) || (err == nil && got != tc.want) {
			t.Errorf("%s: got %d, %v; want %d, %v", tc.name, got, err, tc.want, tc.err)
		}
	}
	ei, err := qcow2.Open(e, qcow2.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer ei.Close()
	if _, err := ei.NextData(context.Background(), 0); !errors.Is(err, qcow2.ErrNoData) {
		t.Errorf("NextData on an empty disk: %v", err)
	}
	if h, err := ei.NextHole(context.Background(), 0); h != 0 || err != nil {
		t.Errorf("NextHole(0) on an empty disk = %d, %v", h, err)
	}
}
