package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"time"

	"github.com/qcowfs/qcowfs/qcow2"
)

type infoCmd struct {
	Image      string `arg:"" help:"The qcow2 image."`
	Output     string `enum:"human,json" default:"human" help:"Output format: human or json (the fields of qemu-img info --output=json)."`
	ForceShare bool   `short:"U" help:"Read the image even if another process (a running qemu) has it open for writing, like qemu-img -U."`
}

func (c *infoCmd) Run() error {
	// Like qemu-img info, describe an image whose corrupt bit is set
	// rather than refuse it: "corrupt: true" is part of the answer.
	// Like qemu-img info, describe the image without opening its
	// backing chain (which may be missing).
	img, err := qcow2.Open(c.Image, qcow2.Options{Cache: qcow2.NewCache(1<<20, 0), AllowCorrupt: true, NoBacking: true})
	if err != nil {
		return err
	}
	defer img.Close()
	if err := img.Lock(c.ForceShare); err != nil {
		return err
	}
	info := img.Info()
	if c.Output == "json" {
		b, err := json.MarshalIndent(info, "", "    ")
		if err != nil {
			return err
		}
		fmt.Printf("%s\n", b)
		return nil
	}
	printInfo(os.Stdout, &info)
	return nil
}

// printInfo prints info the way `qemu-img info` does.
func printInfo(w io.Writer, info *qcow2.Info) {
	fmt.Fprintf(w, "image: %s\n", info.Filename)
	fmt.Fprintf(w, "file format: %s\n", info.Format)
	fmt.Fprintf(w, "virtual size: %s (%d bytes)\n", sizeString(info.VirtualSize), info.VirtualSize)
	fmt.Fprintf(w, "disk size: %s\n", sizeString(info.ActualSize))
	fmt.Fprintf(w, "cluster_size: %d\n", info.ClusterSize)
	if info.DirtyFlag {
		fmt.Fprintln(w, "cleanly shut down: no")
	}
	if info.BackingFilename != "" {
		fmt.Fprintf(w, "backing file: %s", info.BackingFilename)
		if info.FullBackingFilename != info.BackingFilename {
			fmt.Fprintf(w, " (actual path: %s)", info.FullBackingFilename)
		}
		fmt.Fprintln(w)
		if info.BackingFilenameFormat != "" {
			fmt.Fprintf(w, "backing file format: %s\n", info.BackingFilenameFormat)
		}
	}
	if len(info.Snapshots) > 0 {
		fmt.Fprintln(w, "Snapshot list:")
		fmt.Fprintf(w, "%-10s%-17s%8s%20s%13s%11s\n", "ID", "TAG", "VM SIZE", "DATE", "VM CLOCK", "ICOUNT")
		for _, s := range info.Snapshots {
			date := time.Unix(int64(s.DateSec), 0).Format("2006-01-02 15:04:05")
			clock := fmt.Sprintf("%02d:%02d:%02d.%03d", s.VMClockSec/3600, s.VMClockSec/60%60, s.VMClockSec%60, s.VMClockNsec/1e6)
			icount := ""
			if s.Icount != nil {
				icount = fmt.Sprint(*s.Icount)
			}
			fmt.Fprintf(w, "%-10s%-17s%8s%20s%13s%11s\n", s.ID, s.Name, sizeString(int64(s.VMStateSize)), date, clock, icount)
		}
	}
	d := info.FormatSpecific.Data
	fmt.Fprintln(w, "Format specific information:")
	fmt.Fprintf(w, "    compat: %s\n", d.Compat)
	fmt.Fprintf(w, "    compression type: %s\n", d.CompressionType)
	if d.LazyRefcounts != nil {
		fmt.Fprintf(w, "    lazy refcounts: %t\n", *d.LazyRefcounts)
	}
	if len(d.Bitmaps) > 0 {
		fmt.Fprintln(w, "    bitmaps:")
		for i, b := range d.Bitmaps {
			fmt.Fprintf(w, "        [%d]:\n", i)
			fmt.Fprintln(w, "            flags:")
			for j, f := range b.Flags {
				fmt.Fprintf(w, "                [%d]: %s\n", j, f)
			}
			fmt.Fprintf(w, "            name: %s\n", b.Name)
			fmt.Fprintf(w, "            granularity: %d\n", b.Granularity)
		}
	}
	fmt.Fprintf(w, "    refcount bits: %d\n", d.RefcountBits)
	if d.DataFile != "" {
		fmt.Fprintf(w, "    data file: %s\n", d.DataFile)
		fmt.Fprintf(w, "    data file raw: %t\n", *d.DataFileRaw)
	}
	if d.Corrupt != nil {
		fmt.Fprintf(w, "    corrupt: %t\n", *d.Corrupt)
	}
	if d.ExtendedL2 != nil {
		fmt.Fprintf(w, "    extended l2: %t\n", *d.ExtendedL2)
	}
}

// sizeString formats a byte count like qemu's size_to_str: three
// significant digits and a binary unit, switching unit at 1000.
func sizeString(v int64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"}
	if v <= 0 {
		return "0 B"
	}
	_, e := math.Frexp(float64(v) / (1000.0 / 1024.0))
	i := (e - 1) / 10
	if i >= len(units) {
		i = len(units) - 1
	}
	return fmt.Sprintf("%.3g %s", float64(v)/float64(uint64(1)<<(10*i)), units[i])
}
