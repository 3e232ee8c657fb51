package fat

import (
	"errors"
	"sort"
	"sync"

	"github.com/qcowfs/qcowfs/guestfs"
)

// A chain is the cluster chain of one file or directory, learnt from the
// FAT as far as reads have needed it and kept as runs of contiguous
// clusters: one run for a file written in one piece, however long.
//
// Memory is bounded: past maxRuns runs (a badly fragmented file), every
// other run is dropped, and a lookup that falls between two kept runs
// walks the FAT again from the earlier one, as Linux's per-inode
// fat_cache does from its nearest cached position. Time is bounded too: a
// chain longer than the volume's cluster count loops, and is an error, as
// in Linux's fat_get_cluster.
type chain struct {
	t     *fatTable
	start uint32

	mu    sync.Mutex // guards runs and ended
	runs  []run      // by file index; runs[0].file == 0; the last ends where walking stopped
	ended bool       // the last run's last cluster is the chain's last
}

// run is n clusters from disk cluster disk, the file's clusters from index
// file on.
type run struct{ file, disk, n uint32 }

// maxRuns bounds a chain's runs (12 bytes each).
const maxRuns = 2048

// errPastChain: the chain ends before the cluster asked for.
var errPastChain = errors.New("past the end of the cluster chain")

func newChain(t *fatTable, start uint32) *chain {
	return &chain{t: t, start: start, runs: []run{{0, start, 1}}}
}

// lookup returns the disk cluster of the chain's cluster i and how many
// clusters from it are contiguous on disk as far as the chain is known,
// having learnt the chain up to its cluster last (>= i), or to its end.
// A chain shorter than i+1 clusters is errPastChain.
func (ch *chain) lookup(i, last uint32) (disk, contig uint32, err error) {
	ch.mu.Lock()
	defer ch.mu.Unlock()
	if err := ch.extend(last); err != nil && err != errPastChain {
		return 0, 0, err
	}
	if i >= ch.known() {
		return 0, 0, errPastChain
	}
	k := sort.Search(len(ch.runs), func(j int) bool { return ch.runs[j].file > i }) - 1
	r := ch.runs[k]
	if i < r.file+r.n {
		return r.disk + (i - r.file), r.file + r.n - i, nil
	}
	// Between two kept runs (after compact): walk from this one's end.
	cur := r.disk + r.n - 1
	for pos := r.file + r.n - 1; pos < i; pos++ {
		if cur, err = ch.t.next(cur); err != nil {
			return 0, 0, err
		}
		if cur == endOfChain {
			return 0, 0, chainErr(ch.start, "ends at its cluster %d now, further before", pos)
		}
	}
	return cur, 1, nil
}

// known is how many of the chain's clusters have been learnt.
func (ch *chain) known() uint32 {
	r := ch.runs[len(ch.runs)-1]
	return r.file + r.n
}

// extend learns the chain up to its cluster last, or to its end:
// errPastChain if it ends first.
func (ch *chain) extend(last uint32) error {
	limit := ch.t.g.maxCluster - firstCluster // clusters on the volume
	for ch.known() <= last {
		if ch.ended {
			return errPastChain
		}
		r := &ch.runs[len(ch.runs)-1]
		nx, err := ch.t.next(r.disk + r.n - 1)
		if err != nil {
			return err
		}
		if nx == endOfChain {
			ch.ended = true
			continue
		}
		if ch.known() >= limit {
			return chainErr(ch.start, "longer than the volume's %d clusters: it loops", limit)
		}
		if nx == r.disk+r.n {
			r.n++
			continue
		}
		ch.runs = append(ch.runs, run{ch.known(), nx, 1})
		if len(ch.runs) > maxRuns {
			ch.compact()
		}
	}
	return nil
}

// compact keeps every other run, the first and the last always.
func (ch *chain) compact() {
	last := ch.runs[len(ch.runs)-1]
	kept := ch.runs[:0]
	for j := 0; j < len(ch.runs)-1; j += 2 {
		kept = append(kept, ch.runs[j])
	}
	ch.runs = append(kept, last)
}

// length is the chain's cluster count, walking it to its end; more than
// max clusters is an error (of the caller's choosing) without walking on.
func (ch *chain) length(max uint32) (uint32, error) {
	ch.mu.Lock()
	defer ch.mu.Unlock()
	err := ch.extend(max)
	if err == nil {
		return 0, errTooLong
	}
	if err != errPastChain {
		return 0, err
	}
	return ch.known(), nil
}

var errTooLong = errors.New("chain longer than allowed")

func chainErr(start uint32, format string, args ...any) error {
	return withMsg(&guestfs.FormatError{FS: fsType, Field: "cluster chain from", Value: uint64(start)}, format, args...)
}
