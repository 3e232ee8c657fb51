package guesttest

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sort"
	"sync/atomic"
)

// Fuzz targets take a whole image as their input, in EncodeSparse's
// format, so that a seed made by mkfs of a few MiB is a few KiB: the
// fuzzer's minimizer, which runs on every new input, takes minutes over
// inputs of tens of KiB.

// MaxSparseDisk is the largest disk DecodeSparse makes: 1 TiB.
const MaxSparseDisk = 1 << 40

// EncodeSparse encodes b as its runs of bytes that are not zero: for
// each, a uvarint count of zero bytes before it, a uvarint length, and
// the bytes. Runs of fewer than 16 zeros stay inside the runs around them.
func EncodeSparse(b []byte) []byte {
	var out []byte
	prev := 0 // the end of the previous run
	for i := 0; i < len(b); {
		if b[i] == 0 {
			i++
			continue
		}
		j, zeros := i, 0
		for ; j < len(b) && zeros < 16; j++ {
			if b[j] == 0 {
				zeros++
			} else {
				zeros = 0
			}
		}
		j -= zeros
		out = binary.AppendUvarint(out, uint64(i-prev))
		out = binary.AppendUvarint(out, uint64(j-i))
		out = append(out, b[i:j]...)
		prev, i = j, j
	}
	return out
}

// A SparseDisk is a disk decoded from EncodeSparse's format: zeros but
// for its runs. It counts the bytes read from it, and records a read
// outside it (which a reader must never make) as an error.
type SparseDisk struct {
	runs    []dataRun // by increasing offset, not overlapping
	size    int64
	Read    atomic.Int64
	outside atomic.Pointer[error]
}

type dataRun struct {
	off  int64
	data []byte
}

// DecodeSparse decodes data, as far as it decodes, into a disk of size
// bytes, or of the size its runs need if more, but at most MaxSparseDisk
// bytes: runs past that are dropped.
func DecodeSparse(data []byte, size int64) *SparseDisk {
	d := &SparseDisk{size: min(max(size, 0), MaxSparseDisk)}
	var off uint64
	for len(data) > 0 {
		gap, n := binary.Uvarint(data)
		if n <= 0 {
			break
		}
		data = data[n:]
		length, n := binary.Uvarint(data)
		if n <= 0 || length > uint64(len(data)-n) {
			break
		}
		data = data[n:]
		if gap > MaxSparseDisk || off+gap > MaxSparseDisk-length {
			break
		}
		off += gap
		d.runs = append(d.runs, dataRun{off: int64(off), data: data[:length]})
		data = data[length:]
		off += length
	}
	d.size = max(d.size, int64(off))
	return d
}

// Size is the disk's size.
func (d *SparseDisk) Size() int64 { return d.size }

// Outside returns the first read that reached outside the disk, if any.
func (d *SparseDisk) Outside() error {
	if e := d.outside.Load(); e != nil {
		return *e
	}
	return nil
}

func (d *SparseDisk) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 || off > d.size || int64(len(p)) > d.size-off {
		err := fmt.Errorf("read of %d bytes at %d, outside the disk of %d", len(p), off, d.size)
		d.outside.CompareAndSwap(nil, &err)
		return 0, errors.New("outside the disk")
	}
	d.Read.Add(int64(len(p)))
	clear(p)
	end := off + int64(len(p))
	i := sort.Search(len(d.runs), func(i int) bool { return d.runs[i].off+int64(len(d.runs[i].data)) > off })
	for ; i < len(d.runs) && d.runs[i].off < end; i++ {
		r := d.runs[i]
		if r.off >= off {
			copy(p[r.off-off:], r.data)
		} else {
			copy(p, r.data[off-r.off:])
		}
	}
	if len(p) == 0 && off == d.size {
		return 0, io.EOF
	}
	return len(p), nil
}
