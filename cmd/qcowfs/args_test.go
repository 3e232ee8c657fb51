package main

import (
	"slices"
	"testing"
)

func TestHelperArgs(t *testing.T) {
	for _, tc := range []struct{ in, want []string }{
		{[]string{"qcowfs", "mount", "a", "b"}, []string{"qcowfs", "mount", "a", "b"}},
		{[]string{"qcowfs", "info", "x.qcow2"}, []string{"qcowfs", "info", "x.qcow2"}},
		// mount.fuse3 runs "qcowfs SRC MNT -o OPTS".
		{[]string{"qcowfs", "/src", "/mnt", "-o", "ro,allow_other"}, []string{"qcowfs", "mount", "/src", "/mnt", "-o", "ro,allow_other"}},
		// mount(8) runs /sbin/mount.qcowfs SRC MNT [-sfnv] [-o OPTS] [-t TYPE].
		{[]string{"/sbin/mount.qcowfs", "/src", "/mnt", "-n", "-o", "ro", "-t", "fuse.qcowfs"}, []string{"/sbin/mount.qcowfs", "mount", "/src", "/mnt", "-o", "ro"}},
		{[]string{"/sbin/mount.qcowfs", "/src", "/mnt", "-f"}, []string{"/sbin/mount.qcowfs", "mount", "/src", "/mnt", "--fake"}},
		{[]string{"qcowfs", "--help"}, []string{"qcowfs", "--help"}},
	} {
		if got := helperArgs(tc.in); !slices.Equal(got, tc.want) {
			t.Errorf("helperArgs(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

func TestByteSize(t *testing.T) {
	for in, want := range map[string]int64{"0": 0, "4096": 4096, "32M": 32 << 20, "1G": 1 << 30, "512k": 512 << 10, "2MiB": 2 << 20, "1T": 1 << 40} {
		var b byteSize
		if err := b.UnmarshalText([]byte(in)); err != nil || int64(b) != want {
			t.Errorf("%q = %d, %v; want %d", in, b, err, want)
		}
	}
	for _, in := range []string{"", "x", "-1", "1X", "1.5G", "99999999999T"} {
		var b byteSize
		if err := b.UnmarshalText([]byte(in)); err == nil {
			t.Errorf("%q accepted as %d", in, b)
		}
	}
}
