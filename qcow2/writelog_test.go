package qcow2_test

import (
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"sync"
	"syscall"

	"github.com/qcowfs/qcowfs/qcow2"
)

// A write log, as xfstests' dm-log-writes keeps one for a block device:
// every write, punch, allocate, truncate and sync the writer makes on the
// host files of an image, in order, with the bytes written, and marks the
// test puts in (where each guest operation starts, where each flush
// returned). Replaying a prefix of it, or a prefix with some of the
// unsynced writes left out, reordered or torn, rebuilds what the disk
// could hold after a crash at that moment.

type logKind uint8

const (
	logWrite logKind = iota
	logPunch
	logAllocate
	logTruncate
	logSync
	logMark // a test's mark: guest op N begins (N > 0), or flush done (N < 0)
)

type logEntry struct {
	kind logKind
	file int // index into writeLog.names
	off  int64
	n    int64
	data []byte
	mark int
}

// writeLog records the host I/O of the files it wraps. It can also fail
// the failAt-th I/O (counting writes, punches, allocates and syncs, from
// 1) with failErr, for error injection.
type writeLog struct {
	mu      sync.Mutex
	names   []string
	entries []logEntry
	ios     int
	failAt  int
	failErr error
	failed  bool
	failedE logEntry // what failed
}

// wrap returns f recording into the log as file name.
func (wl *writeLog) wrap(f qcow2.WritableFile, name string) qcow2.WritableFile {
	wl.mu.Lock()
	defer wl.mu.Unlock()
	wl.names = append(wl.names, name)
	return &loggedFile{WritableFile: f, log: wl, id: len(wl.names) - 1}
}

func (wl *writeLog) mark(n int) {
	wl.mu.Lock()
	defer wl.mu.Unlock()
	wl.entries = append(wl.entries, logEntry{kind: logMark, mark: n})
}

// io counts one I/O and says whether it must fail.
func (wl *writeLog) io() error {
	wl.ios++
	if wl.failAt > 0 && wl.ios == wl.failAt {
		wl.failed = true
		return wl.failErr
	}
	return nil
}

type loggedFile struct {
	qcow2.WritableFile
	log *writeLog
	id  int
}

func (f *loggedFile) record(e logEntry) error {
	f.log.mu.Lock()
	defer f.log.mu.Unlock()
	// (Truncates are not failed: the writer's only one gives back the
	// growth ahead at close, and its failure leaves a longer file.)
	if e.kind == logTruncate {
		e.file = f.id
		f.log.entries = append(f.log.entries, e)
		return nil
	}
	if err := f.log.io(); err != nil {
		e.file = f.id
		f.log.failedE = e
		return &os.PathError{Op: "injected", Path: f.Name(), Err: err}
	}
	e.file = f.id
	f.log.entries = append(f.log.entries, e)
	return nil
}

func (f *loggedFile) WriteAt(p []byte, off int64) (int, error) {
	if err := f.record(logEntry{kind: logWrite, off: off, n: int64(len(p)), data: append([]byte(nil), p...)}); err != nil {
		return 0, err
	}
	return f.WritableFile.WriteAt(p, off)
}

// CanWriteDirect and WriteDirect make the writer take its O_DIRECT path,
// which leaves writes in flight (behind.go): each is logged as a write when
// it is made.
func (f *loggedFile) CanWriteDirect() bool { return true }

func (f *loggedFile) WriteDirect(b []byte, off int64) error {
	_, err := f.WriteAt(b, off)
	return err
}

func (f *loggedFile) Punch(off, n int64) error {
	if err := f.record(logEntry{kind: logPunch, off: off, n: n}); err != nil {
		return err
	}
	return f.WritableFile.Punch(off, n)
}

func (f *loggedFile) Allocate(off, n int64) error {
	if err := f.record(logEntry{kind: logAllocate, off: off, n: n}); err != nil {
		return err
	}
	return f.WritableFile.Allocate(off, n)
}

func (f *loggedFile) Truncate(size int64) error {
	if err := f.record(logEntry{kind: logTruncate, off: size}); err != nil {
		return err
	}
	return f.WritableFile.Truncate(size)
}

func (f *loggedFile) Sync() error {
	if err := f.record(logEntry{kind: logSync}); err != nil {
		return err
	}
	return f.WritableFile.Sync()
}

// loggingOpener opens data files for writing through the log.
type loggingOpener struct {
	qcow2.LocalOpener
	log  *writeLog
	name string // the name the log gives the data file
}

func (o *loggingOpener) OpenWritable(image qcow2.HostFile, field, name string) (qcow2.WritableFile, error) {
	f, err := o.LocalOpener.OpenWritable(image, field, name)
	if err != nil {
		return nil, err
	}
	return o.log.wrap(f, o.name), nil
}

// replayTo applies entries to the files of dir (named as the log names
// them), as they were before the first entry: those in keep are applied
// (all of them when keep is nil), in the order given by order (the log's
// when nil), and a torn write (index torn) writes only the sectors whose
// bit is set in tornMask.
func (wl *writeLog) replayTo(dir string, entries []logEntry, order []int, torn int, tornMask uint64) error {
	files := map[int]*os.File{}
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	file := func(id int) (*os.File, error) {
		if f := files[id]; f != nil {
			return f, nil
		}
		f, err := os.OpenFile(dir+"/"+wl.names[id], os.O_RDWR, 0)
		files[id] = f
		return f, err
	}
	if order == nil {
		order = make([]int, len(entries))
		for i := range order {
			order[i] = i
		}
	}
	for _, i := range order {
		e := entries[i]
		if e.kind == logMark || e.kind == logSync {
			continue
		}
		f, err := file(e.file)
		if err != nil {
			return err
		}
		switch e.kind {
		case logWrite:
			if i == torn {
				for s := int64(0); s*512 < e.n; s++ {
					if tornMask&(1<<(s%64)) != 0 {
						end := min(e.n, (s+1)*512)
						if _, err := f.WriteAt(e.data[s*512:end], e.off+s*512); err != nil {
							return err
						}
					}
				}
				continue
			}
			if _, err := f.WriteAt(e.data, e.off); err != nil {
				return err
			}
		case logPunch:
			// A punched range reads zeros (the size stays).
			size, _ := f.Seek(0, io.SeekEnd)
			end := min(e.off+e.n, size)
			if end > e.off {
				if err := syscall.Fallocate(int(f.Fd()), 0x02|0x01, e.off, end-e.off); err != nil {
					if _, err := f.WriteAt(make([]byte, end-e.off), e.off); err != nil {
						return err
					}
				}
			}
		case logAllocate:
			size, _ := f.Seek(0, io.SeekEnd)
			if e.off+e.n > size {
				if err := f.Truncate(e.off + e.n); err != nil {
					return err
				}
			}
		case logTruncate:
			if err := f.Truncate(e.off); err != nil {
				return err
			}
		}
	}
	return nil
}

// crashState is one state the disk could be in after a crash: the log up
// to (not including) end is durable where it is before the last sync at
// or before end, and of the entries after that sync a subset is applied,
// in some order, one of them maybe torn.
type crashState struct {
	end      int   // entries [0, end) were issued
	synced   int   // entries [0, synced) are durable (up to the last sync)
	keep     []int // of [synced, end): the ones applied, in order
	torn     int   // an index in keep's entries written torn, or -1
	tornMask uint64
	what     string
}

// crashStates returns the states to check for the log: the state at every
// sync; between syncs, every prefix of the writes since the last sync;
// and as many random subsets (in random order, sometimes with a torn
// write) as random asks for per interval.
func (wl *writeLog) crashStates(r *rand.Rand, random int) []crashState {
	var out []crashState
	lastSync := 0
	for i, e := range wl.entries {
		switch e.kind {
		case logSync:
			out = append(out, crashState{end: i + 1, synced: i + 1, torn: -1, what: fmt.Sprintf("at sync %d", i)})
			lastSync = i + 1
		case logWrite, logPunch, logAllocate, logTruncate:
			// The prefix of the unsynced entries up to this one.
			var keep []int
			for j := lastSync; j <= i; j++ {
				keep = append(keep, j)
			}
			out = append(out, crashState{end: i + 1, synced: lastSync, keep: keep, torn: -1, what: fmt.Sprintf("prefix to %d", i)})
		}
		// At the end of an interval (the next entry syncs, or the log
		// ends), random subsets of the interval.
		if e.kind != logSync && (i+1 == len(wl.entries) || wl.entries[i+1].kind == logSync) {
			var pending []int
			for j := lastSync; j <= i; j++ {
				if k := wl.entries[j].kind; k != logMark {
					pending = append(pending, j)
				}
			}
			if len(pending) == 0 {
				continue
			}
			for range random {
				var keep []int
				for _, j := range pending {
					if r.IntN(2) == 0 {
						keep = append(keep, j)
					}
				}
				r.Shuffle(len(keep), func(a, b int) { keep[a], keep[b] = keep[b], keep[a] })
				s := crashState{end: i + 1, synced: lastSync, keep: keep, torn: -1, what: fmt.Sprintf("subset of (%d, %d]", lastSync, i)}
				// Sometimes one multi-sector write is torn.
				if len(keep) > 0 && r.IntN(2) == 0 {
					t := keep[r.IntN(len(keep))]
					if wl.entries[t].kind == logWrite && wl.entries[t].n > 512 {
						s.torn, s.tornMask = t, r.Uint64()
						s.what += " torn"
					}
				}
				out = append(out, s)
			}
		}
	}
	return out
}
