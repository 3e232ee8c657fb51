package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"golang.org/x/sys/unix"

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

// exitNoChecks is qemu-img check's status for a format without checks.
const exitNoChecks = 63

// Run checks the image like qemu-img check (never writing it) and exits
// like it: 0 clean, 2 corruptions, 3 leaks only, 1 if the check could not
// complete, 63 for a raw file.
func (c *checkCmd) Run() error {
	boundMemory()
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
		return &exitError{code: exitNoChecks, err: errNoChecks}
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
	res, err := o.img.CheckContext(ctx, progress)
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
		if err := printQemuJSON(os.Stdout, res); err != nil {
			return err
		}
	} else {
		printCheck(os.Stdout, res)
	}
	switch {
	case res.CheckErrors > 0:
		return &exitError{code: 1}
	case res.Corruptions > 0:
		return &exitError{code: 2}
	case res.Leaks > 0:
		return &exitError{code: 3}
	}
	return nil
}

// errNoChecks is qemu-img's message for check on a raw image.
var errNoChecks = noChecksError{}

type noChecksError struct{}

func (noChecksError) Error() string { return "This image format does not support checks" }

// printCheck prints the summary the way qemu-img check does.
func printCheck(w io.Writer, r *qcow2.CheckResult) {
	if r.Corruptions == 0 && r.Leaks == 0 && r.CheckErrors == 0 {
		fmt.Fprintln(w, "No errors were found on the image.")
	}
	if r.Corruptions > 0 {
		fmt.Fprintf(w, "\n%d errors were found on the image.\nData may be corrupted, or further writes to the image may corrupt it.\n", r.Corruptions)
	}
	if r.Leaks > 0 {
		fmt.Fprintf(w, "\n%d leaked clusters were found on the image.\nThis means waste of disk space, but no harm to data.\n", r.Leaks)
	}
	if r.CheckErrors > 0 {
		fmt.Fprintf(w, "\n%d internal errors have occurred during the check.\n", r.CheckErrors)
	}
	if r.TotalClusters != 0 && r.AllocatedClusters != 0 {
		a := float64(r.AllocatedClusters)
		fmt.Fprintf(w, "%d/%d = %0.2f%% allocated, %0.2f%% fragmented, %0.2f%% compressed clusters\n",
			r.AllocatedClusters, r.TotalClusters, a*100/float64(r.TotalClusters),
			float64(r.FragmentedClusters)*100/a, float64(r.CompressedClusters)*100/a)
	}
	if r.ImageEndOffset != 0 {
		fmt.Fprintf(w, "Image end offset: %d\n", r.ImageEndOffset)
	}
}

func isTerminal(f *os.File) bool {
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}
