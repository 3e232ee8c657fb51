package fs

import (
	"reflect"
	"strings"
	"testing"
)

func TestAssignNames(t *testing.T) {
	type e struct {
		src   string
		image bool
	}
	for _, tc := range []struct {
		name string
		in   []e
		want []string
	}{
		{"suffixes", []e{{"vm.qcow2", true}, {"b.QCOW", true}, {"c.img", true}, {"disk", true}, {"notes.txt", false}},
			[]string{"vm.raw", "b.raw", "c.raw", "disk.raw", "notes.txt"}},
		{"plain file keeps its name", []e{{"vm.qcow2", true}, {"vm.raw", false}},
			[]string{"vm.qcow2.raw", "vm.raw"}},
		{"images in byte order", []e{{"vm.qcow2", true}, {"vm.img", true}},
			[]string{"vm.qcow2.raw", "vm.raw"}},
		{"a folder wins", []e{{"x.img", true}, {"x.raw", false}},
			[]string{"x.img.raw", "x.raw"}},
		{"fallback taken: hidden", []e{{"a.img", true}, {"a.qcow2", true}, {"a.qcow2.qcow2", true}},
			[]string{"a.raw", "", "a.qcow2.raw"}},
		{"an image named .raw", []e{{"v.raw", true}},
			[]string{"v.raw.raw"}},
		{"a bare suffix is a name", []e{{".img", true}},
			[]string{".img.raw"}},
		// NAME_MAX: a 252-byte image name plus .raw is 256 bytes, which
		// the kernel would refuse in a listing (the whole listing).
		{"names past NAME_MAX", []e{{strings.Repeat("x", 251) + ".img", true}, {strings.Repeat("y", 252), true}, {strings.Repeat("z", 251), true}},
			[]string{strings.Repeat("x", 251) + ".raw", "", strings.Repeat("z", 251) + ".raw"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var srcs []string
			var img []bool
			for _, x := range tc.in {
				srcs = append(srcs, x.src)
				img = append(img, x.image)
			}
			if got := assignNames(srcs, img); !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("assignNames(%v) = %q, want %q", tc.in, got, tc.want)
			}
		})
	}
}

func TestSnapshotNames(t *testing.T) {
	for _, tc := range []struct {
		image, id, name, want, fallback string
	}{
		{"vm.raw", "1", "first", "vm@first.raw", "vm@id-1.raw"},
		{"vm.raw", "2", "two/with slash", "vm@two%2Fwith slash.raw", "vm@id-2.raw"},
		{"vm.raw", "3", "", "vm@3.raw", "vm@id-3.raw"},
		{"vm.raw", "4", "100%\x01\xff", "vm@100%25%01%FF.raw", "vm@id-4.raw"},
		{"vm.raw", "5", "été", "vm@été.raw", "vm@id-5.raw"},
		{"disk.raw.raw", "1", "a", "disk.raw@a.raw", "disk.raw@id-1.raw"},
	} {
		got, fb := snapshotNames(tc.image, tc.id, tc.name)
		if got != tc.want || fb != tc.fallback {
			t.Errorf("snapshotNames(%q, %q, %q) = %q, %q; want %q, %q", tc.image, tc.id, tc.name, got, fb, tc.want, tc.fallback)
		}
	}
}
