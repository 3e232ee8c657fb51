package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"
)

// imageRecipe is bumped when an image recipe changes, so that images built
// by an older recipe are rebuilt instead of silently reused.
const imageRecipe = 1

const (
	kib = int64(1) << 10
	mib = int64(1) << 20
	gib = int64(1) << 30
	tib = int64(1) << 40
)

// An image is one qcow2 test image and its raw twin: a raw file with the
// same bytes (what `qemu-img convert -O raw` makes of it), the ceiling of
// the read workloads and the reference of the copy workloads. Each image
// lives alone in its folder, so that a qcowfs mount of that folder shows
// just it.
type image struct {
	name string
	desc string
	raw  string // name of the raw twin (several images share "plain")
	// make writes the qcow2 image to dst; the raw twin, when this image
	// owns it (raw == name), exists already if rawFirst, or is made from
	// dst afterwards with qemu-img convert.
	make     func(b *bench, dst string) error
	rawFirst func(b *bench, dst string) error // makes the raw twin from scratch
}

// allImages is the whole set; the plan picks from it. The longest builds
// come first: images are built two at a time, and deflate compression
// alone takes over a minute.
var allImages = images()

func images() []*image {
	return []*image{
		{
			name: "deflate", raw: "plain",
			desc: "the plain image compressed with deflate (`qemu-img convert -c`)",
			make: func(b *bench, dst string) error {
				return b.img("convert", "-q", "-c", "-f", "raw", "-O", "qcow2", b.rawPath("plain"), dst)
			},
		},
		{
			name: "zstd", raw: "plain",
			desc: "the plain image compressed with zstd (`qemu-img convert -c -o compression_type=zstd`)",
			make: func(b *bench, dst string) error {
				return b.img("convert", "-q", "-c", "-o", "compression_type=zstd", "-f", "raw", "-O", "qcow2", b.rawPath("plain"), dst)
			},
		},
		{
			name: "plain", raw: "plain",
			desc: "2 GiB of real files (a tar of /usr, cut at 2 GiB), every cluster allocated (`qemu-img convert -S 0`)",
			rawFirst: func(b *bench, dst string) error {
				return writeUsrTar(dst, 2*gib)
			},
			make: func(b *bench, dst string) error {
				return b.img("convert", "-q", "-S", "0", "-f", "raw", "-O", "qcow2", b.rawPath("plain"), dst)
			},
		},
		{
			name: "sparse1t", raw: "sparse1t",
			desc: "1 TiB with 256 MiB of data in 1 MiB pieces, one every 4 GiB (at a varying offset within it)",
			make: func(b *bench, dst string) error {
				var cmds []string
				for i := range int64(256) {
					off := i*4*gib + (i*131%4000)*mib
					cmds = append(cmds, fmt.Sprintf("write -q -P %d %d 1M", i%255+1, off))
				}
				return b.qemuIOScript(dst, tib, "", cmds)
			},
		},
		{
			name: "fragback", raw: "fragback",
			desc: "1 GiB written backwards 64 KiB at a time with qemu-io (host clusters in reverse order)",
			make: func(b *bench, dst string) error {
				var cmds []string
				for i := gib/(64*kib) - 1; i >= 0; i-- {
					cmds = append(cmds, fmt.Sprintf("write -q -P %d %d 64k", i%255+1, i*64*kib))
				}
				return b.qemuIOScript(dst, gib, "", cmds)
			},
		},
		{
			name: "fragfwd", raw: "fragfwd",
			desc: "1 GiB written forwards 64 KiB at a time in two interleaved passes (even chunks, then odd chunks)",
			make: func(b *bench, dst string) error {
				var cmds []string
				for pass := range int64(2) {
					for i := pass; i < gib/(64*kib); i += 2 {
						cmds = append(cmds, fmt.Sprintf("write -q -P %d %d 64k", i%255+1, i*64*kib))
					}
				}
				return b.qemuIOScript(dst, gib, "", cmds)
			},
		},
		{
			name: "prealloc", raw: "prealloc",
			desc: "1 GiB `preallocation=metadata`, 6 MiB of data written (4 MiB at 0, 1 MiB at 300 MiB, the last 1 MiB)",
			make: func(b *bench, dst string) error {
				return b.qemuIOScript(dst, gib, "preallocation=metadata", []string{
					"write -q -P 90 0 4M",
					"write -q -P 91 300M 1M",
					fmt.Sprintf("write -q -P 92 %d 1M", gib-mib),
				})
			},
		},
		{
			name: "guest", raw: "guest",
			desc: "a GPT guest disk: one ext4 partition at 1 MiB holding files copied from /usr/share and /usr/lib",
			rawFirst: func(b *bench, dst string) error {
				return b.makeGuestDisk(dst)
			},
			make: func(b *bench, dst string) error {
				return b.img("convert", "-q", "-f", "raw", "-O", "qcow2", b.rawPath("guest"), dst)
			},
		},
	}
}

// qcowPath is where image name lives: alone in its folder.
func (b *bench) qcowPath(name string) string {
	return filepath.Join(b.cfg.work, "img", name, name+".qcow2")
}

func (b *bench) rawPath(name string) string {
	return filepath.Join(b.cfg.work, "raw", name+".raw")
}

func (b *bench) img(args ...string) error {
	_, err := b.must(&cmd{name: "qemu-img", args: args, timeout: 30 * time.Minute})
	return err
}

// qemuIOScript creates a qcow2 image of size at dst (with the -o option
// opts, if any) and runs the qemu-io commands on it in one qemu-io process,
// with caching that skips flushes: these are test images, not data.
func (b *bench) qemuIOScript(dst string, size int64, opts string, cmds []string) error {
	args := []string{"create", "-q", "-f", "qcow2"}
	if opts != "" {
		args = append(args, "-o", opts)
	}
	if err := b.img(append(args, dst, fmt.Sprint(size))...); err != nil {
		return err
	}
	_, err := b.must(&cmd{
		name: "qemu-io", args: []string{"-t", "unsafe", "-f", "qcow2", dst},
		stdin: strings.NewReader(strings.Join(cmds, "\n") + "\nquit\n"), timeout: 10 * time.Minute,
	})
	return err
}

// A manifest records which images were built, by which recipe and how long
// that took; it lives in the work folder next to the images.
type manifest struct {
	Recipe int                   `json:"recipe"`
	Images map[string]buildEntry `json:"images"`
	// Total is the wall time of every build so far that built
	// something: what building all the images once took.
	Total   float64   `json:"total_seconds"`
	TotalAt time.Time `json:"total_at"`
}

type buildEntry struct {
	Built   time.Time `json:"built"`
	Seconds float64   `json:"seconds"`
}

func (b *bench) manifestPath() string { return filepath.Join(b.cfg.work, "images.json") }

func (b *bench) loadManifest() manifest {
	m := manifest{Recipe: imageRecipe, Images: map[string]buildEntry{}}
	data, err := os.ReadFile(b.manifestPath())
	if err != nil {
		return m
	}
	var old manifest
	if json.Unmarshal(data, &old) == nil && old.Recipe == imageRecipe && old.Images != nil {
		return old
	}
	return m
}

func (b *bench) saveManifest(m manifest) error {
	data, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(b.manifestPath(), append(data, '\n'), 0o644)
}

// buildImages makes the images in need that are missing, and says how long
// that took. The raw twins that others are made from come first; the
// rest are built two at a time (the machine has two cores and most builds
// use one).
func (b *bench) buildImages(need []*image) error {
	man := b.loadManifest()
	var todo []*image
	for _, im := range allImages {
		if !slices.Contains(need, im) {
			continue
		}
		_, known := man.Images[im.name]
		if !known || !exists(b.qcowPath(im.name)) || (im.raw == im.name && !exists(b.rawPath(im.name))) {
			todo = append(todo, im)
		} else if im.raw != im.name && !exists(b.rawPath(im.raw)) {
			todo = append(todo, im)
		}
	}
	if len(todo) == 0 {
		return nil
	}
	names := make([]string, len(todo))
	for i, im := range todo {
		names[i] = im.name
	}
	b.say("building images: %s (once; cached in %s)", strings.Join(names, ", "), b.cfg.work)
	start := time.Now()
	for _, d := range []string{"img", "raw"} {
		if err := os.MkdirAll(filepath.Join(b.cfg.work, d), 0o755); err != nil {
			return err
		}
	}

	// Raw twins made from scratch first: others are converted from them.
	var mu sync.Mutex
	record := func(im *image, t0 time.Time) {
		mu.Lock()
		defer mu.Unlock()
		man.Images[im.name] = buildEntry{Built: time.Now().UTC(), Seconds: time.Since(t0).Seconds()}
	}
	owner := map[string]*image{}
	for _, im := range allImages {
		if im.raw == im.name {
			owner[im.name] = im
		}
	}
	for _, im := range todo {
		if o := owner[im.raw]; o != nil && o.rawFirst != nil && !exists(b.rawPath(im.raw)) {
			t0 := time.Now()
			b.say("  raw %s ...", o.raw)
			if err := b.atomically(b.rawPath(o.raw), func(tmp string) error { return o.rawFirst(b, tmp) }); err != nil {
				return fmt.Errorf("building %s: %w", b.rawPath(o.raw), err)
			}
			b.say("  raw %s: %s", o.raw, time.Since(t0).Round(100*time.Millisecond))
		}
	}

	work := make(chan *image)
	errs := make(chan error, len(todo))
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for im := range work {
				t0 := time.Now()
				err := b.buildOne(im)
				if err == nil {
					record(im, t0)
					b.say("  %s: %s", im.name, time.Since(t0).Round(100*time.Millisecond))
				}
				errs <- err
			}
		}()
	}
	go func() {
		defer close(work)
		for _, im := range todo {
			if b.ctx.Err() != nil {
				return
			}
			work <- im
		}
	}()
	wg.Wait()
	close(errs)
	var all []error
	for err := range errs {
		if err != nil {
			all = append(all, err)
		}
	}
	if b.ctx.Err() != nil {
		all = append(all, errInterrupted)
	}
	// Total adds up the builds: images built at different times.
	man.Total += time.Since(start).Seconds()
	man.TotalAt = time.Now().UTC()
	if err := b.saveManifest(man); err != nil {
		all = append(all, err)
	}
	b.builtNow = time.Since(start)
	b.say("images built in %s", b.builtNow.Round(time.Second))
	return errors.Join(all...)
}

// buildOne makes one qcow2 image, then its raw twin if it owns one that
// is converted from it.
func (b *bench) buildOne(im *image) error {
	if err := os.MkdirAll(filepath.Dir(b.qcowPath(im.name)), 0o755); err != nil {
		return err
	}
	if err := b.atomically(b.qcowPath(im.name), func(tmp string) error { return im.make(b, tmp) }); err != nil {
		return fmt.Errorf("building %s: %w", im.name, err)
	}
	if im.raw == im.name && im.rawFirst == nil {
		err := b.atomically(b.rawPath(im.name), func(tmp string) error {
			return b.img("convert", "-q", "-f", "qcow2", "-O", "raw", b.qcowPath(im.name), tmp)
		})
		if err != nil {
			return fmt.Errorf("building the raw twin of %s: %w", im.name, err)
		}
	}
	return nil
}

// atomically runs make on a temporary name next to dst and renames the
// result to dst, so that a file at dst is always complete.
func (b *bench) atomically(dst string, make func(tmp string) error) error {
	tmp := dst + ".building"
	os.Remove(tmp)
	if err := make(tmp); err != nil {
		os.Remove(tmp)
		return err
	}
	return os.Rename(tmp, dst)
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

// imageByName returns the image of that name.
func imageByName(name string) *image {
	for _, im := range allImages {
		if im.name == name {
			return im
		}
	}
	panic("bench: no image " + name)
}
