package fs

import (
	"reflect"
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
