package qemu

import (
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// chainFiles returns, by chain depth, the file holding each layer's
// clusters (its external data file, if it has one), from
// `qemu-img info --backing-chain`.
func chainFiles(t testing.TB, image string) []string {
	t.Helper()
	var chain []struct {
		Filename       string `json:"filename"`
		FormatSpecific struct {
			Data struct {
				DataFile string `json:"data-file"`
			} `json:"data"`
		} `json:"format-specific"`
	}
	if err := json.Unmarshal(Img(t, "info", "--backing-chain", "--output=json", image), &chain); err != nil {
		t.Fatalf("qemu-img info --backing-chain %s: %v", image, err)
	}
	var out []string
	for _, c := range chain {
		f := c.Filename
		if d := c.FormatSpecific.Data.DataFile; d != "" {
			f = d
		}
		out = append(out, f)
	}
	return out
}

// hostHole reports whether [off, off+n) of the host file holds no written
// data: no extent, or only unwritten (fallocated) ones, by the kernel's
// FIEMAP as filefrag prints it. (lseek(SEEK_DATA) is no oracle here: it
// calls an unwritten extent data as soon as the kernel's readahead has put
// its zero pages in the page cache.) Where FIEMAP is missing (tmpfs),
// lseek answers.
func hostHole(t testing.TB, file string, off, n int64) bool {
	t.Helper()
	out, err := exec.Command("filefrag", "-v", file).Output()
	if err != nil || !strings.Contains(string(out), "ext:") {
		f, err := os.Open(file)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		d, err := unix.Seek(int(f.Fd()), off, unix.SEEK_DATA)
		return errors.Is(err, unix.ENXIO) || (err == nil && d >= off+n)
	}
	// "File size of F is S (B blocks of 4096 bytes)", then one line per
	// extent: "  0:  0..  48:  37814848.. 37814896:  49:  flags".
	bs := int64(4096)
	if m := regexp.MustCompile(`blocks of (\d+) bytes`).FindStringSubmatch(string(out)); m != nil {
		bs, _ = strconv.ParseInt(m[1], 10, 64)
	}
	ext := regexp.MustCompile(`^\s*\d+:\s*(\d+)\.\.\s*(\d+):.*?:\s*\d+:\s*(?:\d+:)?\s*(.*)$`)
	for _, line := range strings.Split(string(out), "\n") {
		m := ext.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		a, _ := strconv.ParseInt(m[1], 10, 64)
		b, _ := strconv.ParseInt(m[2], 10, 64)
		start, end := a*bs, (b+1)*bs
		if start < off+n && end > off && !strings.Contains(m[3], "unwritten") {
			return false
		}
	}
	return true
}

// CheckHoles checks the data runs (sorted [start, end) pairs, holes
// between them) that the code under test reports for image against qemu:
//
//   - where `qemu-img map` says data (and not zero), we report data, unless
//     the host file itself has a hole at qemu's offset for that range (the
//     kernel's lseek says so): those bytes read as zeros and may be a hole;
//   - where qemu says zero, or unallocated, we report a hole;
//   - every byte we call a hole is zero in `qemu-img convert -O raw`'s
//     output.
//
// Call it before anything reads the image's data: the kernel's lseek
// calls a page of an unwritten extent data once it is in the page cache,
// even though it reads as zeros.
func CheckHoles(t testing.TB, image string, data [][2]int64) {
	t.Helper()
	checkHoles(t, image, data, Map(t, image), ToRaw(t, image, filepath.Join(t.TempDir(), "holes-check.raw")))
}

// checkHoles is CheckHoles given qemu's map of image and its raw form.
func checkHoles(t testing.TB, image string, data [][2]int64, qmap []MapEntry, raw string) {
	t.Helper()
	files := chainFiles(t, image)
	// inData tells, for [a, b), how much of it from a is covered by data
	// runs (k > 0) or by a hole (k < 0).
	inData := func(a, b int64) int64 {
		i := sort.Search(len(data), func(i int) bool { return data[i][1] > a })
		if i < len(data) && data[i][0] <= a {
			return min(b, data[i][1]) - a
		}
		next := b
		if i < len(data) {
			next = min(b, data[i][0])
		}
		return -(next - a)
	}
	for _, e := range qmap {
		for a, end := e.Start, e.Start+e.Length; a < end; {
			k := inData(a, end)
			n := k
			if k < 0 {
				n = -k
			}
			switch {
			case k > 0 && e.Zero:
				t.Errorf("%s: [%d, +%d) reported as data; qemu-img map says zero (%+v)", image, a, n, e)
			case k < 0 && e.Data && !e.Zero:
				if e.Offset == nil || e.Depth >= len(files) {
					t.Errorf("%s: [%d, +%d) reported as a hole; qemu-img map says data (%+v)", image, a, n, e)
				} else if host := *e.Offset + (a - e.Start); !hostHole(t, files[e.Depth], host, n) {
					t.Errorf("%s: [%d, +%d) reported as a hole; qemu says data at %s:%d and the host file has data there", image, a, n, files[e.Depth], host)
				}
			}
			a += n
		}
	}
	// Holes read as zeros.
	f, err := os.Open(raw)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, _ := f.Stat()
	buf := make([]byte, 1<<20)
	check := func(a, b int64) {
		for a < b {
			// Only the raw file's data can be non-zero: qemu-img
			// convert leaves zeros as holes.
			d, err := unix.Seek(int(f.Fd()), a, unix.SEEK_DATA)
			if errors.Is(err, unix.ENXIO) || d >= b {
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			h, err := unix.Seek(int(f.Fd()), d, unix.SEEK_HOLE)
			if err != nil {
				t.Fatal(err)
			}
			a = d
			n := min(int64(len(buf)), b-a, h-a)
			if _, err := f.ReadAt(buf[:n], a); err != nil {
				t.Fatal(err)
			}
			for i, c := range buf[:n] {
				if c != 0 {
					t.Errorf("%s: byte %d is in a reported hole but qemu-img convert gives %#x there", image, a+int64(i), c)
					return
				}
			}
			a += n
		}
	}
	prev := int64(0)
	for _, r := range data {
		check(prev, r[0])
		prev = r[1]
	}
	check(prev, st.Size())
}
