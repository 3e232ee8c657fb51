package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/qcowfs/qcowfs/internal/qemuimg"
	"github.com/qcowfs/qcowfs/qcow2"
)

type mapCmd struct {
	imageFlags  `embed:""`
	StartOffset byteSize  `placeholder:"OFFSET" help:"Map from this guest offset on, as qemu-img map --start-offset (default: ${default})." default:"0"`
	MaxLength   *byteSize `placeholder:"LENGTH" help:"Map at most this many bytes, as qemu-img map --max-length (default: to the end)."`
	Compressed  string    `enum:"auto,yes,no" default:"auto" help:"Whether JSON entries carry \"compressed\": auto does what the installed qemu-img does (qemu 8.0 and later print it; 7.2 does not; without qemu-img, yes)."`
	Bitmap      string    `placeholder:"NAME" help:"Map what the persistent bitmap NAME says changed instead, as qemu-img map prints it through qemu-nbd -B NAME (x-dirty-bitmap): the JSON entries with \"data\": false are the dirty ranges; the human form lists the clean ones. A bitmap in use (its writer did not close it cleanly) is refused."`
}

func (c *mapCmd) Help() string {
	return `Examples:

  qcowfs map vm.qcow2
  qcowfs map --output=json --start-offset=1G --max-length=64M vm.qcow2
  qcowfs map --output=json --bitmap daily vm.qcow2

Like qemu-img map, the human output lists only the data that is stored
(and refuses images with compressed clusters, which have no offset to
show); the JSON output lists every range.

With --bitmap, it prints what backup tools read through qemu-nbd -B NAME,
from the image file alone, exactly as

  qemu-img map --output=json --image-opts \
    driver=nbd,server.type=unix,server.path=SOCK,x-dirty-bitmap=qemu:dirty-bitmap:NAME

prints it (the image's name stands for the NBD export's): qemu reports a
dirty range as a hole ("present": false, "data": false) and a clean one as
data at its own offset.`
}

// Run prints the image's map exactly as qemu-img map does
// (qemuimg.WriteMap).
func (c *mapCmd) Run() error {
	boundMemory()
	defer c.closeKeys()
	// qemu opens an image with the corrupt bit read-only, and so maps
	// it; so does this.
	o, err := c.open(qcow2.Options{Cache: qcow2.NewCache(qcow2.DefaultCacheSize, qcow2.DefaultClusterCacheSize), AllowCorrupt: true})
	if err != nil {
		return err
	}
	defer o.Close()
	if c.Bitmap != "" {
		return c.mapBitmap(o)
	}
	size := qemuimg.RawVirtualSize(o.size)
	walk := func(fn func(qcow2.MapEntry) error) error { return qemuimg.RawMap(o.raw, o.size, o.name, fn) }
	if o.img != nil {
		size = o.img.Size()
		walk = func(fn func(qcow2.MapEntry) error) error {
			// Ctrl-C ends a long map rather than leaving it to
			// run.
			ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			return o.img.Map(ctx, fn)
		}
	}
	return qemuimg.WriteMap(os.Stdout, walk, c.options(size))
}

// options are the map's range and form for a disk of size bytes.
func (c *mapCmd) options(size int64) qemuimg.MapOptions {
	opts := qemuimg.MapOptions{
		Start:      int64(c.StartOffset),
		End:        size,
		JSON:       c.Output == "json",
		Compressed: c.Compressed == "yes" || c.Compressed == "auto" && qemuimg.MapPrintsCompressed(),
	}
	if c.MaxLength != nil {
		opts.End = min(opts.End, opts.Start+int64(*c.MaxLength))
	}
	return opts
}

// mapBitmap prints the dirty ranges of bitmap c.Bitmap
// (qemuimg.BitmapMap).
func (c *mapCmd) mapBitmap(o *openedImage) error {
	if o.img == nil {
		return fmt.Errorf("%s: bitmap %q: %w (a raw image has no bitmaps)", o.name, c.Bitmap, qcow2.ErrNoBitmap)
	}
	v, err := o.img.BitmapView(c.Bitmap)
	if err != nil {
		return err
	}
	defer v.Close()
	walk := func(fn func(qcow2.MapEntry) error) error { return qemuimg.BitmapMap(v, o.name, fn) }
	return qemuimg.WriteMap(os.Stdout, walk, c.options(v.Size()))
}
