package main

import (
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"time"

	"github.com/qcowfs/qcowfs/internal/remotefile"
	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/remote"
)

type infoCmd struct {
	imageFlags   `embed:""`
	BackingChain bool `help:"Describe every image of the backing chain, top first, as qemu-img info --backing-chain."`
}

func (c *infoCmd) Help() string {
	return `Examples:

  qcowfs info vm.qcow2
  qcowfs info --output=json --backing-chain vm.qcow2
  qcowfs info -U vm.qcow2          while a qemu runs it

Like qemu-img info, it does not open the backing chain (unless
--backing-chain), describes encrypted images (which mount refuses) and
corrupt ones, and describes any other file as a raw image.`
}

// rawInfo is what qemu-img info says of a raw file.
type rawInfo struct {
	VirtualSize int64  `json:"virtual-size"`
	Filename    string `json:"filename"`
	Format      string `json:"format"`
	ActualSize  int64  `json:"actual-size"`
	DirtyFlag   bool   `json:"dirty-flag"`
}

func (c *infoCmd) Run() error {
	boundMemory()
	var infos []any
	flags := c.imageFlags
	seen := map[string]bool{}
	for {
		info, next, nextFormat, err := describe(&flags)
		if err != nil {
			return err
		}
		infos = append(infos, info)
		if !c.BackingChain || next == "" {
			break
		}
		if remote.IsURL(c.Image) && !remote.Within(next, append([]string{remotefile.Folder(c.Image)}, c.AllowBackingOutside...)) {
			// As the mount confines a chain to the image's folder.
			return fmt.Errorf("%s: backing file %s is outside the image's folder %s (--allow-backing-outside=URL follows it)", remote.Redact(flags.Image), remote.Redact(next), remote.Redact(remotefile.Folder(c.Image)))
		}
		if seen[next] {
			return fmt.Errorf("backing file %q creates an infinite loop", next)
		}
		seen[next] = true
		flags.Image, flags.Format = next, nextFormat
	}
	if c.Output == "json" {
		if c.BackingChain {
			return printQemuJSON(os.Stdout, infos)
		}
		return printQemuJSON(os.Stdout, infos[0])
	}
	for i, info := range infos {
		if i > 0 {
			fmt.Println()
		}
		if err := printInfo(os.Stdout, info); err != nil {
			return err
		}
	}
	return nil
}

// describe returns what qemu-img info says of one image, and the backing
// file it names (with its format, "" to probe).
func describe(f *imageFlags) (info any, next, nextFormat string, err error) {
	// Like qemu-img info, describe an image whose corrupt bit is set
	// rather than refuse it ("corrupt: true" is part of the answer), and
	// do not open its backing chain (which may be missing).
	o, err := f.open(qcow2.Options{Cache: qcow2.NewCache(1<<20, 0), AllowCorrupt: true, NoBacking: true})
	if err != nil {
		var ue *qcow2.UnsupportedError
		if errors.As(err, &ue) || errors.Is(err, qcow2.ErrKey) {
			if info, err2 := describeEncrypted(f); err2 == nil {
				return &info, info.FullBackingFilename, info.BackingFilenameFormat, nil
			} else if !errors.Is(err2, qcow2.ErrNotEncrypted) {
				return nil, "", "", err2
			}
		}
		return nil, "", "", err
	}
	defer o.Close()
	if o.raw != nil {
		return &rawInfo{VirtualSize: rawVirtualSize(o.size), Filename: o.name, Format: "raw", ActualSize: actualSize(o.raw)}, "", "", nil
	}
	qi := o.img.Info()
	next = qi.FullBackingFilename
	if remote.IsURL(f.Image) && qi.BackingFilename != "" {
		// The next image of a remote chain is a URL resolved against
		// this one, in its folder, never a local file.
		u, err := remote.Resolve(f.Image, qi.BackingFilename)
		if err != nil {
			return nil, "", "", err
		}
		next, qi.FullBackingFilename = u, remote.Redact(u)
	}
	return &qi, next, qi.BackingFilenameFormat, nil
}

// describeEncrypted describes an encrypted image, holding a reader's
// locks on it meanwhile, as qemu-img info does.
func describeEncrypted(f *imageFlags) (qcow2.Info, error) {
	file, err := os.Open(f.Image)
	if err != nil {
		return qcow2.Info{}, err
	}
	defer file.Close()
	if err := qcow2.LockFile(file, f.ForceShare); err != nil {
		return qcow2.Info{}, withHint(err)
	}
	return qcow2.DescribeEncrypted(f.Image)
}

// printInfo prints info the way `qemu-img info` does.
func printInfo(w io.Writer, v any) error {
	if r, ok := v.(*rawInfo); ok {
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
