// Command qcowfs shows QEMU qcow2 disk images as raw disk files through
// FUSE:
//
//	qcowfs mount images/ /mnt
//
// makes every qcow2 image under images/ appear under /mnt as a read-only
// raw file of the image's virtual size.
//
// This package parses the command line (kong) and wires the packages
// together: fs and qcow2 for mount (serve.go, in steps: log setup, mount,
// serve, shutdown), remote for URLs, internal/qemuimg for what info, map
// and check print. Its own concerns are those of a command: mount's checks
// before anything is mounted (mount.go), daemonizing (daemon.go), the
// mount-helper convention (fusehelper.go, options.go), where the log goes
// (logging.go), and the control socket that qcowfs status asks
// (control.go, status.go).
package main

import (
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/alecthomas/kong"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

type cli struct {
	Mount   mountCmd   `cmd:"" help:"Mount a folder of qcow2 images (or one image) as raw files."`
	Unmount unmountCmd `cmd:"" aliases:"umount" help:"Unmount a qcowfs mount."`
	Status  statusCmd  `cmd:"" help:"Show what a mount's daemon is doing and which images it refused."`
	Info    infoCmd    `cmd:"" help:"Show an image's details, like qemu-img info."`
	Map     mapCmd     `cmd:"" help:"Show where an image's data lives, like qemu-img map."`
	Check   checkCmd   `cmd:"" help:"Check an image's metadata, like qemu-img check (never writes it)."`
	Version versionCmd `cmd:"" help:"Print the version of qcowfs, Go and go-fuse, and whether libdeflate is built in (also --version)."`
	Help    helpCmd    `cmd:"" help:"Show the help of qcowfs or of one command (qcowfs help mount)."`
	HelpMan manCmd     `cmd:"" name:"help-man" hidden:"" help:"Print the qcowfs(1) man page (troff), made from this help."`

	// Listed once, as the version command, not in every command's
	// flags.
	VersionFlag kong.VersionFlag `name:"version" hidden:"" help:"Print the version."`
}

const description = `qcowfs shows QEMU qcow2 disk images as raw disk files.

  qcowfs mount images/ /mnt      every qcow2 image under images/ appears under
                                 /mnt as a read-only raw file: vm.qcow2 -> vm.raw
  cp --sparse=always /mnt/vm.raw out.raw
  losetup -r -P -f --show /mnt/vm.raw
  qcowfs unmount /mnt

Exit status: 0 success; 1 failure (the reason is printed); 2 a usage
mistake (an unknown command, flag or option, a bad value, a missing
argument). qcowfs check has qemu-img check's codes: 0 clean, 1 the check
could not complete, 2 corruptions, 3 leaks only, 63 the format has no
checks.

Run "qcowfs help COMMAND" or "qcowfs COMMAND --help" for a command's
options and examples.`

// Exit statuses.
const (
	exitFailure = 1
	exitUsage   = 2
)

func main() {
	os.Exit(run(os.Args, os.Stdout, os.Stderr))
}

// run parses args (args[0] is the program name) and runs the command;
// it returns the exit status.
func run(args []string, stdout, stderr io.Writer) int {
	parser, err := newParser(stdout, stderr)
	if err != nil {
		// A mistake in the flag declarations, not the user's.
		fmt.Fprintf(stderr, "qcowfs: internal error: %v\n", err)
		return exitFailure
	}
	inv, err := prepareArgs(parser.Model, args)
	if err != nil {
		fmt.Fprintf(stderr, "qcowfs: %v\n", err)
		return exitUsage
	}
	ctx, err := parser.Parse(inv.args[1:])
	if err != nil {
		fmt.Fprintf(stderr, "qcowfs: %s\n", usageError(err, inv))
		return exitUsage
	}
	if err := ctx.Run(inv); err != nil {
		code := exitFailure
		var ee *exitError
		if errors.As(err, &ee) {
			code, err = ee.code, ee.err
		}
		if err != nil {
			fmt.Fprintf(stderr, "qcowfs: %v\n", err)
		}
		return code
	}
	return 0
}

// exited is how kong's --help and --version end the program; a test
// parser replaces it.
var exited = os.Exit

func newParser(stdout, stderr io.Writer) (*kong.Kong, error) {
	return kong.New(&cli{},
		kong.Name("qcowfs"),
		kong.Description(description),
		kong.Writers(stdout, stderr),
		kong.Exit(func(code int) { exited(code) }),
		kong.ConfigureHelp(kong.HelpOptions{Compact: true}),
		kong.Vars{"version": versionLine(), "options_help": optionsHelp()},
	)
}

// usageError is the one line printed for a parse error: kong's reason,
// with the flag named as the user wrote it (an -o option rewritten into
// a flag is named as the option) and a pointer to the right --help.
func usageError(err error, inv *invocation) string {
	msg := err.Error()
	for flag, opt := range inv.fromOption {
		if r, ok := replacePrefixWord(msg, flag, "-o "+opt); ok {
			msg = r
			break
		}
	}
	help := "qcowfs --help"
	var pe *kong.ParseError
	if errors.As(err, &pe) && pe.Context != nil {
		if cmd := pe.Context.Selected(); cmd != nil {
			help = "qcowfs " + cmd.Name + " --help"
		}
	}
	return fmt.Sprintf("%s (see %s)", msg, help)
}

// exitError carries a specific exit status out of a command; err, if not
// nil, is printed first.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return fmt.Sprint(e.err) }

// usageErrorf is a usage mistake found after parsing (a combination of
// flags, an option value): exit status 2.
func usageErrorf(format string, args ...any) error {
	return &exitError{code: exitUsage, err: fmt.Errorf(format, args...)}
}
