package qemuimg

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"regexp"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/qcow2"
)

// MapOptions say which part of the disk qemu-img map prints, and how.
type MapOptions struct {
	// Start and End bound the guest range: --start-offset, and the end
	// of the disk or Start plus --max-length, whichever comes first
	// (qemu-img.c, img_map).
	Start, End int64
	JSON       bool // --output=json
	// Compressed: JSON entries carry "compressed", as qemu 8.0 and
	// later print it (MapPrintsCompressed).
	Compressed bool
}

// A MapWalk calls fn with the entries of a whole disk in order, and stops
// with fn's error: qcow2.Image.Map, or RawMap for a raw file.
type MapWalk func(fn func(qcow2.MapEntry) error) error

// NoOffsetError is qemu-img map's refusal to print, in its human form,
// data that lies at no offset of a file (compressed clusters).
type NoOffsetError struct{}

func (NoOffsetError) Error() string {
	return "File contains external, encrypted or compressed clusters."
}

// WriteMap prints the map of [o.Start, o.End) that walk gives exactly as
// qemu-img map does, so that tools written for it work unchanged: the
// human form lists only the data that is stored (and fails with
// NoOffsetError at a compressed cluster, after the lines before it), the
// JSON form lists every range.
func WriteMap(w io.Writer, walk MapWalk, o MapOptions) error {
	bw := bufio.NewWriter(w)
	defer bw.Flush()
	first := true
	emit := func(e qcow2.MapEntry) error {
		if o.JSON {
			if first {
				bw.WriteString("[")
			} else {
				bw.WriteString(",\n")
			}
			fmt.Fprintf(bw, `{ "start": %d, "length": %d, "depth": %d, "present": %t, "zero": %t, "data": %t`,
				e.Start, e.Length, e.Depth, e.Present, e.Zero, e.Data)
			if o.Compressed {
				fmt.Fprintf(bw, `, "compressed": %t`, e.Compressed)
			}
			if e.Offset != nil {
				fmt.Fprintf(bw, `, "offset": %d`, *e.Offset)
			}
			bw.WriteString("}")
			first = false
			return nil
		}
		if first {
			fmt.Fprintf(bw, "%-16s%-16s%-16s%s\n", "Offset", "Length", "Mapped to", "File")
			first = false
		}
		if e.Data && e.Offset == nil {
			// qemu-img's words (qemu-img.c, dump_map_entry): a
			// compressed cluster has no offset to show.
			return NoOffsetError{}
		}
		if e.Data && !e.Zero {
			fmt.Fprintf(bw, "%-16s%-16s%-16s%s\n", cHex(e.Start), cHex(e.Length), cHex(*e.Offset), e.File)
		}
		return nil
	}
	clip := func(e qcow2.MapEntry) error {
		// Keep the part of e inside [start, end), as qemu-img map
		// asks block status from start-offset on.
		if e.Start >= o.End {
			return errStopMap
		}
		if e.Start+e.Length <= o.Start {
			return nil
		}
		if e.Start < o.Start {
			d := o.Start - e.Start
			e.Start, e.Length = o.Start, e.Length-d
			if e.Offset != nil {
				off := *e.Offset + d
				e.Offset = &off
			}
		}
		e.Length = min(e.Length, o.End-e.Start)
		return emit(e)
	}
	var err error
	if o.Start >= o.End {
		// An empty range: qemu-img map prints the one entry it starts
		// from, of no length, which the human form leaves out.
		emit(qcow2.MapEntry{Start: o.Start})
	} else {
		err = walk(clip)
	}
	if errors.Is(err, errStopMap) {
		err = nil
	}
	if err != nil {
		return err
	}
	if o.JSON {
		if first {
			bw.WriteString("[")
		}
		bw.WriteString("]\n")
	} else if first {
		fmt.Fprintf(bw, "%-16s%-16s%-16s%s\n", "Offset", "Length", "Mapped to", "File")
	}
	return nil
}

// errStopMap ends a map walk past --max-length.
var errStopMap = errors.New("stop")

// RawMap walks a raw file of size bytes, named name, as qemu's file driver
// maps it: data where the file has data, zero (with the offset, as it is
// the same file) in its holes, and zero past its end up to the size
// rounded up to whole 512-byte sectors, which is the size qemu gives a raw
// image (RawVirtualSize).
func RawMap(f *os.File, size int64, name string, fn func(qcow2.MapEntry) error) error {
	fd := int(f.Fd())
	var pending *qcow2.MapEntry
	add := func(start, end int64, data bool) error {
		if pending != nil && pending.Data == data {
			pending.Length = end - pending.Start
			return nil
		}
		if pending != nil {
			if err := fn(*pending); err != nil {
				return err
			}
		}
		at := start
		pending = &qcow2.MapEntry{Start: start, Length: end - start, Present: true, Data: data, Zero: !data, Offset: &at, File: name}
		return nil
	}
	for off := int64(0); off < size; {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if err != nil || data > size {
			data = size // ENXIO: no data after off
		}
		if data > off {
			if err := add(off, data, false); err != nil {
				return err
			}
			off = data
			continue
		}
		hole, err := unix.Seek(fd, off, unix.SEEK_HOLE)
		if err != nil || hole > size {
			hole = size
		}
		if err := add(off, hole, true); err != nil {
			return err
		}
		off = hole
	}
	if end := RawVirtualSize(size); end > size {
		if err := add(size, end, false); err != nil {
			return err
		}
	}
	if pending != nil {
		return fn(*pending)
	}
	return nil
}

// MapPrintsCompressed reports whether the installed qemu-img prints
// "compressed" in map's JSON, which it does from qemu 8.0 on; without
// qemu-img, the current format.
func MapPrintsCompressed() bool {
	out, err := exec.Command("qemu-img", "--version").Output()
	if err != nil {
		return true
	}
	m := regexp.MustCompile(`qemu-img version (\d+)\.`).FindSubmatch(out)
	if m == nil {
		return true
	}
	major, _ := strconv.Atoi(string(m[1]))
	return major >= 8
}

// cHex formats like C's "%#x": 0x-prefixed, except zero, which is "0".
func cHex(v int64) string {
	if v == 0 {
		return "0"
	}
	return fmt.Sprintf("%#x", v)
}
