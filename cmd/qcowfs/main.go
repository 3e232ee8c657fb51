// Command qcowfs shows QEMU qcow2 disk images as raw disk files through
// FUSE:
//
//	qcowfs mount images/ /mnt
//
// makes every qcow2 image under images/ appear under /mnt as a read-only
// raw file of the image's virtual size. This package only parses the
// command line and wires packages qcow2 and fs together.
package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/alecthomas/kong"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

type cli struct {
	Mount   mountCmd   `cmd:"" help:"Mount a folder of qcow2 images (or one image) as raw files."`
	Unmount unmountCmd `cmd:"" aliases:"umount" help:"Unmount a qcowfs mount."`
	Info    infoCmd    `cmd:"" help:"Show an image's details, like qemu-img info."`
	Map     mapCmd     `cmd:"" help:"Show where an image's data lives, like qemu-img map."`
	Check   checkCmd   `cmd:"" help:"Check an image's metadata, like qemu-img check (never writes it)."`
	Version versionCmd `cmd:"" help:"Print the version."`

	VersionFlag kong.VersionFlag `name:"version" help:"Print the version."`
}

const description = `qcowfs shows QEMU qcow2 disk images as raw disk files.

  qcowfs mount images/ /mnt      every qcow2 image under images/ appears under
                                 /mnt as a read-only raw file: vm.qcow2 -> vm.raw
  cp --sparse=always /mnt/vm.raw out.raw
  losetup -r -P -f --show /mnt/vm.raw
  qcowfs unmount /mnt

Run "qcowfs <command> --help" for a command's options.`

func main() {
	var c cli
	ctx := kong.Parse(&c,
		kong.Name("qcowfs"),
		kong.Description(description),
		kong.UsageOnError(),
		kong.ConfigureHelp(kong.HelpOptions{Compact: true}),
		kong.Vars{"version": "qcowfs " + version},
	)
	if err := ctx.Run(); err != nil {
		code := 1
		var ee *exitError
		if errors.As(err, &ee) {
			code, err = ee.code, ee.err
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "qcowfs: %v\n", err)
		}
		os.Exit(code)
	}
}

// exitError carries a specific exit status out of a command; err, if not
// nil, is printed first.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return fmt.Sprint(e.err) }

func init() {
	os.Args = helperArgs(os.Args)
}

// helperArgs rewrites the mount helper calling convention into a mount
// command. mount(8) runs mount.fuse3, which runs "qcowfs SRC MNT -o OPTS";
// installed as /sbin/mount.qcowfs or /sbin/mount.fuse.qcowfs, qcowfs is
// called as "mount.qcowfs SRC MNT [-o OPTS]" directly.
func helperArgs(args []string) []string {
	if len(args) < 2 {
		return args
	}
	// Called by mount(8) itself (as /sbin/mount.qcowfs), or by
	// mount.fuse3 or a user as "qcowfs SRC MNT ...".
	byMount := strings.HasPrefix(filepath.Base(args[0]), "mount.")
	helper := byMount
	if !helper {
		switch args[1] {
		case "mount", "unmount", "umount", "info", "map", "check", "version", "help":
			return args
		}
		helper = len(args) >= 3 && !strings.HasPrefix(args[1], "-") && !strings.HasPrefix(args[2], "-")
	}
	if !helper {
		return args
	}
	out := []string{args[0], "mount"}
	for i := 1; i < len(args); i++ {
		a := args[i]
		// mount(8) may pass -n (no mtab), -s (sloppy), -f (fake), -v
		// and, for a helper whose name does not end with the type,
		// -t TYPE; only -o carries anything for us.
		switch {
		case a == "-n", a == "-s", a == "-v":
			continue
		case a == "-t" && byMount:
			i++ // and its value
			continue
		case a == "-f" && byMount:
			// Fake: mount(8) only records the mount. As
			// "qcowfs SRC MNT -f" (libfuse style) it stays
			// --foreground.
			out = append(out, "--fake")
			continue
		}
		out = append(out, a)
	}
	return out
}

type versionCmd struct{}

func (versionCmd) Run() error {
	fmt.Println("qcowfs", version)
	return nil
}
