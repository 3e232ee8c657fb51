package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/internal/qemuimg"
	"github.com/qcowfs/qcowfs/qcow2"
)

type checkCmd struct {
	imageFlags `embed:""`
}

func (c *checkCmd) Help() string {
	return `Examples:

  qcowfs check vm.qcow2
  qcowfs check --output=json -U vm.qcow2

Exit status as qemu-img check's: 0 no errors, 1 the check could not
complete (or the image could not be opened, its backing file included),
2 corruptions, 3 leaked clusters only, 63 the format does not support
checks (a raw file).`
}

// Run checks the image like qemu-img check (never writing it) and exits
// like it: 0 clean, 2 corruptions, 3 leaks only, 1 if the check could not
// complete, 63 for a raw file.
func (c *checkCmd) Run() error {
	boundMemory()
	defer c.closeKeys()
	// Like qemu-img check, open the backing chain too: an image whose
	// backing file is missing cannot be checked.
	o, err := c.open(qcow2.Options{
		Cache:         qcow2.NewCache(qcow2.DefaultCacheSize, 1<<20),
		AllowCorrupt:  true,
		LenientTables: true,
	})
	if err != nil {
		return err
	}
	defer o.Close()
	if o.raw != nil {
		return &exitError{code: qemuimg.StatusNoChecks, err: qemuimg.ErrNoChecks}
	}
	var progress func(done, total int64)
	if isTerminal(os.Stderr) {
		progress = func(done, total int64) {
			fmt.Fprintf(os.Stderr, "\rchecking %s: %d%%", c.Image, done*100/max(total, 1))
		}
	}
	// Ctrl-C ends the check (exit 1) rather than leaving it to run.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	res, err := o.img.Check(ctx, progress)
	if progress != nil {
		fmt.Fprint(os.Stderr, "\r\033[K")
	}
	for _, m := range res.Messages {
		fmt.Fprintln(os.Stderr, m)
	}
	if err != nil {
		res.CheckErrors++
		fmt.Fprintf(os.Stderr, "qcowfs: the check could not complete: %v\n", err)
	}
	if c.Output == "json" {
		if err := qemuimg.WriteJSON(os.Stdout, res); err != nil {
			return err
		}
	} else {
		qemuimg.WriteCheck(os.Stdout, res)
	}
	if code := qemuimg.CheckStatus(res); code != 0 {
		return &exitError{code: code}
	}
	return nil
}

func isTerminal(f *os.File) bool {
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}
