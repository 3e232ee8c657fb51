package main

import (
	"maps"
	"testing"
	"time"
)

// The calls counted are those that started inside the command's window,
// each once even when another thread's line cut it in two, and an output
// strace could not have written is an error, not a count of zero.
func TestCountStraceCalls(t *testing.T) {
	from := time.Unix(1796229136, 500_000_000)
	to := from.Add(time.Second)
	out := `12847 1796229136.100000 pread64(3, "QFI\373"..., 4096, 0) = 4096
12847 1796229136.600000 ioctl(3, FS_IOC_FIEMAP, {fm_start=0, fm_length=1048576}) = 0
12850 1796229136.700000 pread64(3,  <unfinished ...>
12851 1796229136.700100 ioctl(3, FS_IOC_FIEMAP, {fm_start=1048576, fm_length=1048576}) = 0
12850 1796229136.700200 <... pread64 resumed>"..."..., 65536, 196608) = 65536
12851 1796229137.400000 lseek(3, 0, SEEK_DATA) = 0
12851 1796229137.600000 lseek(3, 0, SEEK_HOLE) = 1073741824
`
	got, err := countStraceCalls(out, from, to)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int64{"ioctl": 2, "pread64": 1, "lseek": 1}
	if !maps.Equal(got, want) {
		t.Errorf("counted %v, want %v", got, want)
	}
	for _, bad := range []string{
		"12847 1796229136.600000 futex(0x1, FUTEX_WAKE, 1) = 0\n", // not a traced call
		"12847 ioctl(3, FS_IOC_FIEMAP) = 0\n",                     // no time (-ttt missing)
		"garbage\n",
	} {
		if got, err := countStraceCalls(bad, from, to); err == nil {
			t.Errorf("%q: counted %v, want an error", bad, got)
		}
	}
}
