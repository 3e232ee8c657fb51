package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"syscall"
)

// Checking a copy: its allocated size and whether its bytes are the raw
// twin's. A plain cmp of a 1 TiB sparse file reads a terabyte of zeros, so
// the comparison reads only the ranges where either file has data
// (SEEK_DATA/SEEK_HOLE); where both have holes both read as zeros.

// allocated is the space a file takes on its file system (du).
func allocated(path string) (int64, error) {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return 0, err
	}
	return st.Blocks * 512, nil
}

type sameResult struct {
	equal bool
	why   string // where they differ
}

// sameBytes compares two files byte for byte, like cmp.
func sameBytes(pa, pb string) (sameResult, error) {
	fa, err := os.Open(pa)
	if err != nil {
		return sameResult{}, err
	}
	defer fa.Close()
	fb, err := os.Open(pb)
	if err != nil {
		return sameResult{}, err
	}
	defer fb.Close()
	sa, err := fa.Stat()
	if err != nil {
		return sameResult{}, err
	}
	sb, err := fb.Stat()
	if err != nil {
		return sameResult{}, err
	}
	if sa.Size() != sb.Size() {
		return sameResult{why: fmt.Sprintf("sizes differ: %d and %d bytes", sa.Size(), sb.Size())}, nil
	}
	ra, err := dataRanges(fa, sa.Size())
	if err != nil {
		return sameResult{}, err
	}
	rb, err := dataRanges(fb, sb.Size())
	if err != nil {
		return sameResult{}, err
	}
	bufA, bufB := make([]byte, 1<<20), make([]byte, 1<<20)
	for _, r := range mergeRanges(append(ra, rb...)) {
		for off := r[0]; off < r[1]; {
			n := int(min(int64(len(bufA)), r[1]-off))
			if _, err := fa.ReadAt(bufA[:n], off); err != nil && err != io.EOF {
				return sameResult{}, err
			}
			if _, err := fb.ReadAt(bufB[:n], off); err != nil && err != io.EOF {
				return sameResult{}, err
			}
			if !bytes.Equal(bufA[:n], bufB[:n]) {
				i := 0
				for bufA[i] == bufB[i] {
					i++
				}
				return sameResult{why: fmt.Sprintf("first difference at byte %d", off+int64(i))}, nil
			}
			off += int64(n)
		}
	}
	return sameResult{equal: true}, nil
}

const (
	seekData = 3 // SEEK_DATA
	seekHole = 4 // SEEK_HOLE
)

// dataRanges lists the [start, end) ranges of f that hold data; the whole
// file when its file system does not tell holes apart.
func dataRanges(f *os.File, size int64) ([][2]int64, error) {
	var out [][2]int64
	for off := int64(0); off < size; {
		d, err := f.Seek(off, seekData)
		if errors.Is(err, syscall.ENXIO) {
			break
		}
		if errors.Is(err, syscall.EINVAL) || errors.Is(err, syscall.EOPNOTSUPP) {
			return [][2]int64{{0, size}}, nil
		}
		if err != nil {
			return nil, err
		}
		h, err := f.Seek(d, seekHole)
		if err != nil {
			return nil, err
		}
		out = append(out, [2]int64{d, h})
		off = h
	}
	return out, nil
}

// mergeRanges sorts ranges and merges the ones that overlap or touch.
func mergeRanges(rs [][2]int64) [][2]int64 {
	slices.SortFunc(rs, func(a, b [2]int64) int {
		switch {
		case a[0] < b[0]:
			return -1
		case a[0] > b[0]:
			return 1
		}
		return 0
	})
	var out [][2]int64
	for _, r := range rs {
		if n := len(out); n > 0 && r[0] <= out[n-1][1] {
			out[n-1][1] = max(out[n-1][1], r[1])
			continue
		}
		out = append(out, r)
	}
	return out
}

// humanBytes renders n in binary units: "0 B", "12 KiB", "256 MiB", "1.50 GiB".
func humanBytes(n int64) string {
	switch {
	case n < 1<<10:
		return fmt.Sprintf("%d B", n)
	case n < 1<<20:
		return fmt.Sprintf("%.0f KiB", float64(n)/(1<<10))
	case n < 1<<30:
		return fmt.Sprintf("%.0f MiB", float64(n)/(1<<20))
	case n < 1<<40:
		return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
	}
	return fmt.Sprintf("%.2f TiB", float64(n)/(1<<40))
}
