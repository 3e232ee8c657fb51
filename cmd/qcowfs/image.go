package main

import (
	"errors"
	"fmt"
	"os"
	"runtime/debug"

	"github.com/qcowfs/qcowfs/internal/keys"
	"github.com/qcowfs/qcowfs/internal/qemuimg"
	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/remote"
)

// info, map and check share how they name, open and lock an image, with
// qemu-img's flags and its probing: a file that is not qcow2 is raw.

// imageFlags are the flags info, map and check share.
type imageFlags struct {
	Image      string `arg:"" help:"The image file: qcow2, or any other file, which is read as raw (as qemu-img probes it); or the http://, https:// or s3:// URL of a qcow2 image."`
	Format     string `short:"f" placeholder:"FMT" help:"The image's format, as qemu-img -f: qcow2 (a file that is not one is an error) or raw (a qcow2 image read as a raw file). Default: probed."`
	Output     string `enum:"human,json" default:"human" help:"Output format: human or json, as qemu-img prints them (the same fields, in the same order)."`
	ForceShare bool   `short:"U" help:"Read the image even if another process (a running qemu) has it open for writing, like qemu-img -U."`
	// The chain of a remote image is confined as the mount confines it.
	AllowBackingOutside []string `placeholder:"URL" sep:"none" help:"For a remote image: also follow backing and data files under this URL prefix (repeat the flag for more). By default they must lie in the image's folder."`
	remoteFlags         `embed:""`
	// --key-dir names files by their path relative to the image's
	// folder here.
	keyFlags `embed:""`

	// keys is loaded by the first open, and shared by the flags'
	// copies (info --backing-chain opens one image after another, all
	// with the first one's folder as the root of --key-dir).
	keys **keys.Ring
}

// ring loads the key flags once (nil without them).
func (f *imageFlags) ring() (*keys.Ring, error) {
	if f.keys == nil {
		f.keys = new(*keys.Ring)
	}
	if *f.keys != nil || f.KeyFile == "" && f.KeyDir == "" {
		return *f.keys, nil
	}
	r, warnings, err := f.loadKeys(false)
	if err != nil {
		return nil, err
	}
	for _, w := range warnings {
		fmt.Fprintf(os.Stderr, "qcowfs: warning: %s\n", w)
	}
	root, err := keyRoot(f.Image, false)
	if err != nil {
		r.Close()
		return nil, err
	}
	r.AddRoot(root)
	r.OnWarning(func(format string, args ...any) { fmt.Fprintf(os.Stderr, "qcowfs: warning: "+format+"\n", args...) })
	*f.keys = r
	return r, nil
}

// closeKeys clears the keys, at the end of the command.
func (f *imageFlags) closeKeys() {
	if f.keys != nil {
		(*f.keys).Close()
	}
}

// keyHinted adds to a KeyError where its passphrase came from.
func (f *imageFlags) keyHinted(err error) error {
	if err == nil || f.keys == nil {
		return err
	}
	return hintWith(err, keyHint(*f.keys, err))
}

// allowedURLs checks --allow-backing-outside: URL prefixes only (a local
// image's chain is followed as qemu-img follows it).
func (f *imageFlags) allowedURLs() ([]string, error) {
	for _, a := range f.AllowBackingOutside {
		if !remote.IsURL(a) {
			return nil, usageErrorf("--allow-backing-outside=%s: info, map and check take URL prefixes here, for remote images", a)
		}
	}
	return f.AllowBackingOutside, nil
}

// An openedImage is an image opened and locked for info, map or check:
// a qcow2 image, or a raw file.
type openedImage struct {
	name   string
	img    *qcow2.Image // nil for a raw file
	raw    *os.File     // nil for a qcow2 image
	size   int64        // of the raw file
	client *remote.Client
}

func (o *openedImage) Close() {
	if o.img != nil {
		o.img.Close()
	}
	if o.client != nil {
		o.client.Close()
	}
	if o.raw != nil {
		o.raw.Close()
	}
}

// format returns the image's format: -f, or else what its first bytes
// say.
func (f *imageFlags) format() (string, error) {
	switch f.Format {
	case "qcow2", "raw":
		return f.Format, nil
	case "":
	default:
		return "", fmt.Errorf("%s: format %q: qcowfs reads qcow2 and raw images only", f.Image, f.Format)
	}
	st, err := os.Stat(f.Image)
	if err != nil {
		return "", err
	}
	if st.IsDir() {
		return "", fmt.Errorf("%s: is a directory", f.Image)
	}
	ok, err := qcow2.IsQcow2(f.Image)
	if err != nil {
		return "", err
	}
	if ok {
		return "qcow2", nil
	}
	return "raw", nil
}

// open opens and locks the image, as qemu-img does: the locks of a
// read-only reader unless -U.
func (f *imageFlags) open(opts qcow2.Options) (*openedImage, error) {
	r, err := f.ring()
	if err != nil {
		return nil, err
	}
	opts.Passphrase = passphrases(r)
	o, err := f.openImage(opts)
	return o, f.keyHinted(err)
}

func (f *imageFlags) openImage(opts qcow2.Options) (*openedImage, error) {
	if remote.IsURL(f.Image) {
		return f.openRemote(opts)
	}
	format, err := f.format()
	if err != nil {
		return nil, err
	}
	o := &openedImage{name: f.Image}
	if format == "raw" {
		if o.raw, err = os.Open(f.Image); err != nil {
			return nil, err
		}
		st, err := o.raw.Stat()
		if err == nil && st.IsDir() {
			err = fmt.Errorf("%s: is a directory", f.Image)
		}
		if err != nil {
			o.Close()
			return nil, err
		}
		o.size = st.Size()
		if err := qcow2.LockFile(o.raw, f.ForceShare); err != nil {
			o.Close()
			return nil, withHint(err)
		}
		return o, nil
	}
	if opts.Cache == nil {
		opts.Cache = qcow2.NewCache(qcow2.DefaultCacheSize, 1<<20)
	}
	allowed, err := f.allowedURLs()
	if err != nil {
		return nil, err
	}
	ub := &urlBackingOpener{local: &qcow2.LocalOpener{AllowedDirs: opts.AllowedDirs}, flags: &f.remoteFlags, allowed: allowed}
	opts.Opener = ub
	defer func() {
		if o.img == nil && ub.client != nil {
			ub.client.Close()
		}
	}()
	if o.img, err = qcow2.Open(f.Image, opts); err != nil {
		if !opts.NoBacking && !errors.Is(err, qcow2.ErrUnsupported) {
			// Say which file failed, as qemu-img does: the image
			// itself, or its backing chain.
			alone := opts
			alone.NoBacking = true
			if img, err2 := qcow2.Open(f.Image, alone); err2 == nil {
				img.Close()
				return nil, &qemuimg.BackingError{Image: f.Image, Err: err}
			}
		}
		return nil, err
	}
	o.client = ub.client
	if err := o.img.Lock(f.ForceShare); err != nil {
		o.Close()
		return nil, withHint(err)
	}
	return o, nil
}

// openRemote opens a remote qcow2 image; its backing files must lie in
// its folder (on the same server, or in the same bucket and prefix) or
// under an --allow-backing-outside prefix.
func (f *imageFlags) openRemote(opts qcow2.Options) (*openedImage, error) {
	if f.Format == "raw" {
		return nil, fmt.Errorf("%s: remote images are read as qcow2 only", remote.Redact(f.Image))
	}
	if f.Format != "" && f.Format != "qcow2" {
		return nil, fmt.Errorf("%s: format %q: qcowfs reads qcow2 and raw images only", remote.Redact(f.Image), f.Format)
	}
	allowed, err := f.allowedURLs()
	if err != nil {
		return nil, err
	}
	c, err := f.client(nil)
	if err != nil {
		return nil, err
	}
	if opts.Cache == nil {
		opts.Cache = qcow2.NewCache(qcow2.DefaultCacheSize, 1<<20)
	}
	img, err := openRemoteImage(c, f.Image, opts, allowed)
	if err != nil {
		c.Close()
		return nil, withHint(err)
	}
	return &openedImage{name: remote.Redact(f.Image), img: img, client: c}, nil
}

// oneShotMemory is the soft memory limit of info, map and check: the
// garbage collector works harder as the heap nears it, so that a hostile
// image's huge tables (65,535 snapshots, say) are freed as they are walked
// instead of piling up until the next collection the default pacing
// would start. What the image really needs is charged to the memory budget
// (qcow2.Options.Budget); this only keeps garbage from counting too.
const oneShotMemory = 128 << 20

func boundMemory() { debug.SetMemoryLimit(oneShotMemory) }
