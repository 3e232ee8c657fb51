package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"regexp"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/qcow2"
)

type mapCmd struct {
	imageFlags  `embed:""`
	StartOffset byteSize  `placeholder:"OFFSET" help:"Map from this guest offset on, as qemu-img map --start-offset (default: ${default})." default:"0"`
	MaxLength   *byteSize `placeholder:"LENGTH" help:"Map at most this many bytes, as qemu-img map --max-length (default: to the end)."`
	Compressed  string    `enum:"auto,yes,no" default:"auto" help:"Whether JSON entries carry \"compressed\": auto does what the installed qemu-img does (qemu 8.0 and later print it; 7.2 does not; without qemu-img, yes)."`
}

func (c *mapCmd) Help() string {
	return `Examples:

  qcowfs map vm.qcow2
  qcowfs map --output=json --start-offset=1G --max-length=64M vm.qcow2

Like qemu-img map, the human output lists only the data that is stored
(and refuses images with compressed clusters, which have no offset to
show); the JSON output lists every range.`
}

// noOffsetError is qemu-img map's refusal to print, in its human form,
// data that lies at no offset of a file (compressed clusters).
type noOffsetError struct{}

func (noOffsetError) Error() string {
	return "File contains external, encrypted or compressed clusters."
}

// Run prints the image's map exactly as qemu-img map does, so tools
// written for it work unchanged.
func (c *mapCmd) Run() error {
	boundMemory()
	// qemu opens an image with the corrupt bit read-only, and so maps
	// it; so does this.
	o, err := c.open(qcow2.Options{Cache: qcow2.NewCache(qcow2.DefaultCacheSize, qcow2.DefaultClusterCacheSize), AllowCorrupt: true})
	if err != nil {
		return err
	}
	defer o.Close()
	size := rawVirtualSize(o.size)
	if o.img != nil {
		size = o.img.Size()
	}
	// The range as qemu-img map computes it (qemu-img.c, img_map):
	// from --start-offset to the end of the disk or start-offset plus
	// --max-length, whichever comes first.
	start, end := int64(c.StartOffset), size
	if c.MaxLength != nil {
		end = min(end, start+int64(*c.MaxLength))
	}
	withCompressed := c.Compressed == "yes" || c.Compressed == "auto" && qemuMapPrintsCompressed()

	w := bufio.NewWriter(os.Stdout)
	defer w.Flush()
	first := true
	emit := func(e qcow2.MapEntry) error {
		if c.Output == "json" {
			if first {
				w.WriteString("[")
			} else {
				w.WriteString(",\n")
			}
			fmt.Fprintf(w, `{ "start": %d, "length": %d, "depth": %d, "present": %t, "zero": %t, "data": %t`,
				e.Start, e.Length, e.Depth, e.Present, e.Zero, e.Data)
			if withCompressed {
				fmt.Fprintf(w, `, "compressed": %t`, e.Compressed)
			}
			if e.Offset != nil {
				fmt.Fprintf(w, `, "offset": %d`, *e.Offset)
			}
			w.WriteString("}")
			first = false
			return nil
		}
		if first {
			fmt.Fprintf(w, "%-16s%-16s%-16s%s\n", "Offset", "Length", "Mapped to", "File")
			first = false
		}
		if e.Data && e.Offset == nil {
			// qemu-img's words (qemu-img.c, dump_map_entry): a
			// compressed cluster has no offset to show.
			return noOffsetError{}
		}
		if e.Data && !e.Zero {
			fmt.Fprintf(w, "%-16s%-16s%-16s%s\n", cHex(e.Start), cHex(e.Length), cHex(*e.Offset), e.File)
		}
		return nil
	}
	clip := func(e qcow2.MapEntry) error {
		// Keep the part of e inside [start, end), as qemu-img map
		// asks block status from start-offset on.
		if e.Start >= end {
			return errStopMap
		}
		if e.Start+e.Length <= start {
			return nil
		}
		if e.Start < start {
			d := start - e.Start
			e.Start, e.Length = start, e.Length-d
			if e.Offset != nil {
				off := *e.Offset + d
				e.Offset = &off
			}
		}
		e.Length = min(e.Length, end-e.Start)
		return emit(e)
	}
	switch {
	case start >= end:
		// An empty range: qemu-img map prints the one entry it
		// starts from, of no length, which the human form leaves
		// out.
		emit(qcow2.MapEntry{Start: start})
	case o.img != nil:
		// Ctrl-C ends a long map rather than leaving it to run.
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		err = o.img.MapContext(ctx, clip)
	default:
		err = rawMap(o, clip)
	}
	if errors.Is(err, errStopMap) {
		err = nil
	}
	if err != nil {
		return err
	}
	if c.Output == "json" {
		if first {
			w.WriteString("[")
		}
		w.WriteString("]\n")
	} else if first {
		fmt.Fprintf(w, "%-16s%-16s%-16s%s\n", "Offset", "Length", "Mapped to", "File")
	}
	return nil
}

// errStopMap ends a map walk past --max-length.
var errStopMap = errors.New("stop")

// rawMap maps a raw file as qemu's file driver does: data where the file
// has data, zero (with the offset, as it is the same file) in its holes,
// and zero past its end up to the size rounded up to whole 512-byte
// sectors, which is the size qemu gives a raw image.
func rawMap(o *openedImage, fn func(qcow2.MapEntry) error) error {
	fd := int(o.raw.Fd())
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
		pending = &qcow2.MapEntry{Start: start, Length: end - start, Present: true, Data: data, Zero: !data, Offset: &at, File: o.name}
		return nil
	}
	for off := int64(0); off < o.size; {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if err != nil || data > o.size {
			data = o.size // ENXIO: no data after off
		}
		if data > off {
			if err := add(off, data, false); err != nil {
				return err
			}
			off = data
			continue
		}
		hole, err := unix.Seek(fd, off, unix.SEEK_HOLE)
		if err != nil || hole > o.size {
			hole = o.size
		}
		if err := add(off, hole, true); err != nil {
			return err
		}
		off = hole
	}
	if end := rawVirtualSize(o.size); end > o.size {
		if err := add(o.size, end, false); err != nil {
			return err
		}
	}
	if pending != nil {
		return fn(*pending)
	}
	return nil
}

// rawVirtualSize is the size qemu gives a raw file: rounded up to whole
// 512-byte sectors.
func rawVirtualSize(fileSize int64) int64 { return (fileSize + 511) &^ 511 }

// qemuMapPrintsCompressed reports whether the installed qemu-img prints
// "compressed" in map's JSON, which it does from qemu 8.0 on; without
// qemu-img, the current format.
func qemuMapPrintsCompressed() bool {
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
