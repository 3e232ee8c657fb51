package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/qcowfs/qcowfs/remote"
)

// The files and folders a mount reads or writes for itself: its log, the
// disk cache, the keys, the throwaway overlays' folder, the runtime
// folder of its control socket, the folders backing files may come from.
// None may lie inside the mount point: once mounted, every access of the
// daemon's to them would be a request to the daemon itself, served while
// the request that made it waits (a folder's scan, an image's open), and
// the mount would hang for good. Nor inside a source folder: the mount
// would show them (a passphrase as a plain file, the daemon's own
// overlays as images). preflight refuses both, with one line naming the
// flag, before anything is mounted; fs refuses what a path still leads
// there (a backing file name, a symlink) at the request (fs/selfguard.go).

// An ownPath is one file or folder of the mount's own.
type ownPath struct {
	flag string // how the user named it: "--cache-dir", "--overlay=temp (TMPDIR=/x)"
	path string // absolute
	// inSource: lying inside a source folder is refused too (the mount
	// would show it); folders the daemon only reads from, whatever the
	// source holds, need not be outside it.
	inSource bool
}

// ownPaths lists the mount's own files and folders that the flags and
// the environment name.
func (c *mountCmd) ownPaths() []ownPath {
	var out []ownPath
	add := func(flag, path string, inSource bool) {
		if path != "" {
			out = append(out, ownPath{flag, path, inSource})
		}
	}
	add("--log-file", c.LogFile, true)
	add("--cpu-profile", c.CPUProfile, true)
	add("--cache-dir", c.CacheDir, true)
	add("--ca-file", c.CAFile, true)
	add("--key-file", c.KeyFile, true)
	add("--key-dir", c.KeyDir, true)
	if c.Overlay == tempOverlay {
		flag := "--overlay=temp"
		if d := os.Getenv("TMPDIR"); d != "" {
			flag += " (TMPDIR=" + d + ")"
		}
		add(flag+": the folder of throwaway overlays", tempOverlayRoot(), true)
	}
	flag := "the runtime folder of the control socket"
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" && os.Geteuid() != 0 {
		flag += " (XDG_RUNTIME_DIR=" + d + ")"
	}
	add(flag, runtimeDir(), true)
	for _, d := range c.AllowBackingOutside {
		if !remote.IsURL(d) {
			add("--allow-backing-outside", d, false)
		}
	}
	return out
}

// checkOwnPaths refuses a file or folder of the mount's own (ownPaths)
// that lies inside the mount point mnt, or inside the source folder src
// ("" for a remote source or a single image), or that is the single
// image img itself ("" unless the source is one). mnt, src and img are
// real paths (no symlinks).
func (c *mountCmd) checkOwnPaths(mnt, src, img string) error {
	for _, p := range c.ownPaths() {
		real := realPath(p.path)
		switch {
		case within(real, mnt):
			return fmt.Errorf("%s %s: inside the mount point %s; the daemon would wait on its own mount (put it outside the mount point)", p.flag, p.path, c.Mountpoint)
		case p.inSource && src != "" && within(real, src):
			return fmt.Errorf("%s %s: inside the source folder %s; the mount would show it (put it outside the source)", p.flag, p.path, c.Source)
		case img != "" && real == img:
			return fmt.Errorf("%s %s: is the source image %s", p.flag, p.path, c.Source)
		}
	}
	return nil
}

// realPath is where path (absolute) leads once its symlinks are
// resolved, whether or not it exists yet: the longest part that exists is
// resolved and the rest appended, and a dangling symlink is followed to
// where its target would be. A path that cannot be resolved (a folder it
// may not search) is taken as written: the check is then as good as the
// path, and fs still refuses the daemon's requests to its own mount.
func realPath(path string) string {
	for range 40 { // the kernel's MAXSYMLINKS
		dir, rest := path, ""
		var real string
		for {
			r, err := filepath.EvalSymlinks(dir)
			if err == nil {
				real = r
				break
			}
			if !errors.Is(err, os.ErrNotExist) || dir == "/" {
				return filepath.Clean(path)
			}
			rest = filepath.Join(filepath.Base(dir), rest)
			dir = filepath.Dir(dir)
		}
		if rest == "" {
			return real
		}
		// real/first does not resolve: missing, or a symlink to
		// something missing.
		first, tail, _ := strings.Cut(rest, "/")
		target, err := os.Readlink(filepath.Join(real, first))
		if err != nil {
			return filepath.Join(real, rest)
		}
		if !filepath.IsAbs(target) {
			target = filepath.Join(real, target)
		}
		path = filepath.Join(target, tail)
	}
	return filepath.Clean(path)
}
