package fs

import (
	"fmt"
	"path"
	"sync"
	"syscall"
)

// The file descriptor budget: open images hold descriptors (every file of
// a backing chain, and one per file to probe its holes), and the process
// has RLIMIT_NOFILE of them. The Go runtime raises the soft limit to the
// hard one less one at start; three quarters of it go to open images, the rest stay for what
// must always work: listing folders, opening plain files, the FUSE
// device. One folder may hold at most half of the images' share, so that
// a folder whose files are all open at once cannot starve the others. An
// image that would go over is not opened: EMFILE, with a log line (at most
// one every ten seconds).
//
// A listing holds no descriptor between requests (scan.go opens, reads
// and closes each image it validates), so only open handles and the
// background data count use the budget.

type fdBudget struct {
	nofile    int // the soft RLIMIT_NOFILE
	mu        sync.Mutex
	limit     int // descriptors for open images, in all
	perFolder int // and in one folder
	used      int
	byFolder  map[string]int
}

// newFDBudget sizes the budget from the process's soft RLIMIT_NOFILE.
func newFDBudget() *fdBudget {
	var rl syscall.Rlimit
	limit := 1024
	if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl) == nil && rl.Cur > 0 {
		limit = int(min(rl.Cur, 1<<30))
	}
	images := max(limit*3/4, 16)
	return &fdBudget{nofile: limit, limit: images, perFolder: max(images/2, 8), byFolder: map[string]int{}}
}

// fdBudgetError is why an image was not opened: the budget is spent. It is
// EMFILE to the reader.
type fdBudgetError struct {
	folder          string
	used, limit, in int
}

func (e *fdBudgetError) Error() string {
	return fmt.Sprintf("file descriptor budget spent: open images hold %d of %d descriptors (%d in folder %q, at most half of them per folder)",
		e.used, e.limit, e.in, e.folder)
}

func (e *fdBudgetError) Unwrap() error { return syscall.EMFILE }

// take reserves n descriptors for an image at rel, or fails.
func (b *fdBudget) take(rel string, n int) error {
	folder := path.Dir(rel)
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.used+n > b.limit || b.byFolder[folder]+n > b.perFolder {
		return &fdBudgetError{folder: folder, used: b.used, limit: b.limit, in: b.byFolder[folder]}
	}
	b.used += n
	b.byFolder[folder] += n
	return nil
}

// give returns n descriptors taken for an image at rel.
func (b *fdBudget) give(rel string, n int) {
	folder := path.Dir(rel)
	b.mu.Lock()
	defer b.mu.Unlock()
	b.used -= n
	if b.byFolder[folder] -= n; b.byFolder[folder] <= 0 {
		delete(b.byFolder, folder)
	}
}
