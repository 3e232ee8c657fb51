package main

import (
	"errors"
	"fmt"
	"os"

	"github.com/qcowfs/qcowfs/internal/qemuimg"
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
--backing-chain), describes encrypted images (with their key, or from
their header without it) and corrupt ones, and describes any other file
as a raw image.`
}

func (c *infoCmd) Run() error {
	boundMemory()
	defer c.closeKeys()
	var infos []any
	if _, err := c.ring(); err != nil {
		return err
	}
	flags := c.imageFlags
	seen := map[string]bool{}
	// The first remote image of the chain (the image, or the backing
	// file of a local overlay): the rest of the chain lies in its
	// folder, as the mount confines a chain.
	first := ""
	for {
		info, next, nextFormat, err := describe(&flags)
		if err != nil {
			return err
		}
		infos = append(infos, info)
		if !c.BackingChain || next == "" {
			break
		}
		if remote.IsURL(flags.Image) && first == "" {
			first = flags.Image
		}
		if first != "" && !remote.Within(next, append([]string{remotefile.Folder(first)}, c.AllowBackingOutside...)) {
			return fmt.Errorf("%s: backing file %s is outside the image's folder %s (--allow-backing-outside=URL follows it)", remote.Redact(flags.Image), remote.Redact(next), remote.Redact(remotefile.Folder(first)))
		}
		if seen[next] {
			return fmt.Errorf("backing file %q creates an infinite loop", next)
		}
		seen[next] = true
		flags.Image, flags.Format = next, nextFormat
	}
	if c.Output == "json" {
		if c.BackingChain {
			return qemuimg.WriteJSON(os.Stdout, infos)
		}
		return qemuimg.WriteJSON(os.Stdout, infos[0])
	}
	for i, info := range infos {
		if i > 0 {
			fmt.Println()
		}
		if err := qemuimg.WriteInfo(os.Stdout, info); err != nil {
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
		var ke *qcow2.KeyError
		if errors.As(err, &ke) && !ke.Missing {
			// qemu-img info never unlocks the key (it opens without
			// I/O), so a wrong one does not stop it; this says so,
			// and describes the image from its header as it does.
			fmt.Fprintf(os.Stderr, "qcowfs: warning: %v; described without opening it\n", err)
		}
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
		return qemuimg.DescribeRaw(o.name, o.raw, o.size), "", "", nil
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
