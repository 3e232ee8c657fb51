package qemuimg

import (
	"fmt"
	"io"

	"github.com/qcowfs/qcowfs/qcow2"
)

// StatusNoChecks is qemu-img check's exit status for a format without
// checks (a raw file), which it reports with ErrNoChecks.
const StatusNoChecks = 63

// ErrNoChecks is qemu-img's message for check on a raw image.
var ErrNoChecks error = noChecksError{}

type noChecksError struct{}

func (noChecksError) Error() string { return "This image format does not support checks" }

// CheckStatus is qemu-img check's exit status for r: 1 if the check could
// not complete, else 2 for corruptions, else 3 for leaks, else 0.
func CheckStatus(r *qcow2.CheckResult) int {
	switch {
	case r.CheckErrors > 0:
		return 1
	case r.Corruptions > 0:
		return 2
	case r.Leaks > 0:
		return 3
	}
	return 0
}

// WriteCheck prints the summary of r the way qemu-img check does.
func WriteCheck(w io.Writer, r *qcow2.CheckResult) {
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
