package qcow2

import (
	"fmt"
)

// Backing chains: an image, its external data file, its backing file, and
// so on down, each opened through Options.Opener (opener.go has the
// default, for local files).
//
// The chain refuses to loop (a file it already opened, told apart by
// identity), to grow deeper than Options.MaxChainDepth, and to read a
// backing file in an unknown format. A backing file's format comes from the
// image's backing-format extension; only when that is absent is it probed
// (qcow2 magic: qcow2; anything else: raw, with a warning).

// chain opens one backing chain, remembering every file it opened.
type chain struct {
	opts Options
	seen map[any]string // file identity -> name
}

// identity is what tells two host files apart for loop detection.
func identity(f HostFile) any {
	if id, ok := f.(identified); ok {
		return id.ID()
	}
	return "name:" + f.Name()
}

// visit records f as part of the chain, refusing it if it already is.
func (c *chain) visit(f HostFile) error {
	id := identity(f)
	if prev, ok := c.seen[id]; ok {
		return &RefusedError{File: prev, Field: "backing file", Name: f.Name(), Reason: "the backing chain loops back to " + prev}
	}
	c.seen[id] = f.Name()
	return nil
}

// open opens the file image names in field, through the opener, and adds
// it to the chain. writable asks for a file the writer can change, where
// the opener can give one.
func (c *chain) open(image HostFile, field, name string, writable bool) (HostFile, error) {
	var f HostFile
	var err error
	if wo, ok := c.opts.Opener.(WritableOpener); ok && writable {
		f, err = wo.OpenWritable(image, field, name)
	} else {
		f, err = c.opts.Opener.Open(image, field, name)
	}
	if err != nil {
		return nil, err
	}
	if err := c.visit(f); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// openQcow2 reads the qcow2 image in f with its data file and backing
// chain. It owns f: on error, f is closed, and so is everything opened
// for it.
func (c *chain) openQcow2(f HostFile, depth int) (*layer, error) {
	l, err := newQcow2Layer(f, depth, &c.opts)
	if err != nil {
		f.Close()
		return nil, err
	}
	if err := c.completeQcow2(l, depth); err != nil {
		for x := l; x != nil; x = x.backing {
			x.close()
		}
		return nil, err
	}
	return l, nil
}

// completeQcow2 builds the metadata map of the qcow2 layer l and opens its
// data file and backing chain.
func (c *chain) completeQcow2(l *layer, depth int) error {
	// The metadata map is built now: an image whose metadata cannot be
	// mapped (or does not fit in the budget) is refused, never served
	// without the check that keeps metadata out of guest data. Lenient
	// opens (the image check) go on without it; their reads then fail.
	if _, err := l.metadata(); err != nil && !c.opts.LenientTables {
		return err
	}
	h, name, f := l.hdr, l.name, l.file
	if h.IncompatibleFeatures&IncompatCorrupt != 0 && c.opts.Warnf != nil {
		c.opts.Warnf("%s: corrupt bit set: qemu found the image inconsistent; reading it anyway (read-only) as asked", name)
	}
	if h.IncompatibleFeatures&IncompatDirty != 0 && c.opts.Warnf != nil {
		c.opts.Warnf("%s: dirty bit set (not cleanly closed); refcounts may be stale, which does not matter for reading", name)
	}
	if h.IncompatibleFeatures&IncompatExternalData != 0 {
		df, err := c.open(f, "data file", h.DataFile, depth == 0 && c.opts.Writable)
		if err != nil {
			return fmt.Errorf("%s: data file: %w", name, err)
		}
		l.dataFile = df
		size, err := df.Size()
		if err != nil {
			return err
		}
		l.dataLen.Store(size)
	}
	if h.BackingFile == "" || c.opts.NoBacking {
		return nil
	}
	if depth+1 > c.opts.MaxChainDepth {
		return &RefusedError{File: name, Field: "backing file", Name: h.BackingFile,
			Reason: fmt.Sprintf("backing chain deeper than %d", c.opts.MaxChainDepth)}
	}
	b, err := c.open(f, "backing file", h.BackingFile, false)
	if err != nil {
		return fmt.Errorf("%s: backing file: %w", name, err)
	}
	l.backing, err = c.openBacking(name, b, h.BackingFormat, depth+1)
	return err
}

// openBacking opens the backing file f of image parent in format fmt
// ("qcow2", "raw", or "" for probing). It owns f.
func (c *chain) openBacking(parent string, f HostFile, format string, depth int) (*layer, error) {
	if format == "" {
		if ok, err := ProbeFile(f); err == nil && ok {
			format = "qcow2"
		} else {
			format = "raw"
			if c.opts.Warnf != nil {
				c.opts.Warnf("%s: backing file %s has no format in the image; reading it as raw", parent, f.Name())
			}
		}
	}
	switch format {
	case "qcow2":
		b, err := c.openQcow2(f, depth)
		if err != nil {
			return nil, fmt.Errorf("%s: backing file: %w", parent, err)
		}
		return b, nil
	case "raw":
		size, err := f.Size()
		if err != nil {
			f.Close()
			return nil, err
		}
		l := &layer{name: f.Name(), file: f, depth: depth, raw: true}
		l.fileLen.Store(size)
		l.virtSize.Store(size)
		return l, nil
	default:
		f.Close()
		return nil, &UnsupportedError{File: parent, Feature: fmt.Sprintf("backing file format %q", format)}
	}
}

// IsQcow2 reports whether qemu takes the file at path for a qcow2 image
// (Probe).
func IsQcow2(path string) (bool, error) {
	f, err := OpenFile(path)
	if err != nil {
		return false, err
	}
	defer f.Close()
	return ProbeFile(f)
}
