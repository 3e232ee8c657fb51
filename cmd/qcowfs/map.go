package main

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/qcowfs/qcowfs/qcow2"
)

type mapCmd struct {
	Image      string `arg:"" help:"The qcow2 image."`
	Output     string `enum:"human,json" default:"human" help:"Output format: human or json (the output of qemu-img map --output=json)."`
	ForceShare bool   `short:"U" help:"Read the image even if another process (a running qemu) has it open for writing, like qemu-img -U."`
}

// Run prints the image's map exactly as qemu-img map does, so tools
// written for it work unchanged. The JSON entries also carry
// "compressed", as qemu 8 and later print it.
func (c *mapCmd) Run() error {
	img, err := qcow2.Open(c.Image, qcow2.Options{Cache: qcow2.NewCache(qcow2.DefaultCacheSize, qcow2.DefaultClusterCacheSize)})
	if err != nil {
		return err
	}
	defer img.Close()
	if err := img.Lock(c.ForceShare); err != nil {
		return err
	}
	w := bufio.NewWriter(os.Stdout)
	defer w.Flush()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if c.Output == "json" {
		first := true
		err := img.MapContext(ctx, func(e qcow2.MapEntry) error {
			if first {
				w.WriteString("[")
				first = false
			} else {
				w.WriteString(",\n")
			}
			fmt.Fprintf(w, `{ "start": %d, "length": %d, "depth": %d, "present": %t, "zero": %t, "data": %t, "compressed": %t`,
				e.Start, e.Length, e.Depth, e.Present, e.Zero, e.Data, e.Compressed)
			if e.Offset != nil {
				fmt.Fprintf(w, `, "offset": %d`, *e.Offset)
			}
			w.WriteString("}")
			return nil
		})
		if err != nil {
			return err
		}
		w.WriteString("]\n")
		return nil
	}
	fmt.Fprintf(w, "%-16s%-16s%-16s%s\n", "Offset", "Length", "Mapped to", "File")
	return img.MapContext(ctx, func(e qcow2.MapEntry) error {
		if e.Data && e.Offset == nil {
			return fmt.Errorf("%s: the image contains compressed clusters, which have no offset to show; use --output=json", c.Image)
		}
		if e.Data && !e.Zero {
			fmt.Fprintf(w, "%-16s%-16s%-16s%s\n", cHex(e.Start), cHex(e.Length), cHex(*e.Offset), e.File)
		}
		return nil
	})
}

// cHex formats like C's "%#x": 0x-prefixed, except zero, which is "0".
func cHex(v int64) string {
	if v == 0 {
		return "0"
	}
	return fmt.Sprintf("%#x", v)
}
