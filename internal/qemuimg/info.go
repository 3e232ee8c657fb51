package qemuimg

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/qcowfs/qcowfs/qcow2"
)

// RawInfo is what qemu-img info says of a raw file.
type RawInfo struct {
	VirtualSize int64  `json:"virtual-size"`
	Filename    string `json:"filename"`
	Format      string `json:"format"`
	ActualSize  int64  `json:"actual-size"`
	DirtyFlag   bool   `json:"dirty-flag"`
}

// DescribeRaw describes the raw file f of size bytes, named name, as
// qemu-img info does.
func DescribeRaw(name string, f *os.File, size int64) *RawInfo {
	return &RawInfo{VirtualSize: RawVirtualSize(size), Filename: name, Format: "raw", ActualSize: actualSize(f)}
}

// RawVirtualSize is the size qemu gives a raw file: rounded up to whole
// 512-byte sectors.
func RawVirtualSize(fileSize int64) int64 { return (fileSize + 511) &^ 511 }

// actualSize is the space a file takes on its host, as qemu's actual-size.
func actualSize(f *os.File) int64 {
	var st syscall.Stat_t
	if syscall.Fstat(int(f.Fd()), &st) != nil {
		return 0
	}
	return st.Blocks * 512
}

// WriteInfo prints info (a *qcow2.Info or a *RawInfo) the way `qemu-img
// info` does.
func WriteInfo(w io.Writer, v any) error {
	if r, ok := v.(*RawInfo); ok {
		fmt.Fprintf(w, "image: %s\n", r.Filename)
		fmt.Fprintf(w, "file format: %s\n", r.Format)
		fmt.Fprintf(w, "virtual size: %s (%d bytes)\n", sizeString(r.VirtualSize), r.VirtualSize)
		fmt.Fprintf(w, "disk size: %s\n", sizeString(r.ActualSize))
		return nil
	}
	info := v.(*qcow2.Info)
	fmt.Fprintf(w, "image: %s\n", info.Filename)
	fmt.Fprintf(w, "file format: %s\n", info.Format)
	fmt.Fprintf(w, "virtual size: %s (%d bytes)\n", sizeString(info.VirtualSize), info.VirtualSize)
	if info.ActualSize != nil {
		fmt.Fprintf(w, "disk size: %s\n", sizeString(*info.ActualSize))
	} else {
		fmt.Fprintln(w, "disk size: unavailable")
	}
	if info.Encrypted {
		fmt.Fprintln(w, "encrypted: yes")
	}
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
	// The format specific part is qemu's QDict, dumped key by key.
	data, err := toQobject(info.FormatSpecific.Data)
	if err != nil {
		return err
	}
	fmt.Fprintln(w, "Format specific information:")
	data.dump(w, 1)
	return nil
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

// BackingError is an image that opens but whose backing chain does not,
// in qemu-img's words.
type BackingError struct {
	Image string // the image, as named
	Err   error  // why its chain did not open
}

func (e *BackingError) Error() string {
	msg := e.Err.Error()
	var pe *fs.PathError
	if errors.As(e.Err, &pe) {
		// As qemu says it: the file, and strerror's capital.
		reason := pe.Err.Error()
		msg = "Could not open '" + pe.Path + "': " + strings.ToUpper(reason[:1]) + reason[1:]
	}
	return "Could not open '" + e.Image + "': Could not open backing file: " + msg
}

func (e *BackingError) Unwrap() error { return e.Err }
