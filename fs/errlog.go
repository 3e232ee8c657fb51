package fs

import (
	"sync"
	"time"
)

// The reads and writes that failed since the mount, for qcowfs status:
// counted per image (by its path, whether it is open now or not) and in
// all, each with its last failure. The log says more, but only once per
// open image (readFailed, writeFailed).

// ErrorCounts counts failed requests of one image, or of all.
type ErrorCounts struct {
	ReadErrors  int64 `json:"read-errors"`  // reads and lseeks
	WriteErrors int64 `json:"write-errors"` // writes, flushes, discards, zeroing, growing
	// LastError is the last of them, nil if none.
	LastError *FailedOp `json:"last-error,omitempty"`
}

// A FailedOp is one failed request.
type FailedOp struct {
	Time   time.Time `json:"time"`
	Image  string    `json:"image"`
	Op     string    `json:"op"`     // "read" or "write"
	Offset int64     `json:"offset"` // in the disk; -1 for a flush
	Error  string    `json:"error"`
}

// errorLog is the mount's ErrorCounts; mu guards it.
type errorLog struct {
	mu     sync.Mutex
	total  ErrorCounts
	images map[string]*ErrorCounts // at most maxIdentities images
}

// note counts a failed request of the image at path.
func (l *errorLog) note(path, op string, off int64, err error) {
	f := &FailedOp{Time: time.Now(), Image: path, Op: op, Offset: off, Error: err.Error()}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.images == nil {
		l.images = map[string]*ErrorCounts{}
	}
	c := l.images[path]
	if c == nil && len(l.images) < maxIdentities {
		c = &ErrorCounts{}
		l.images[path] = c
	}
	for _, c := range []*ErrorCounts{&l.total, c} {
		if c == nil {
			continue
		}
		if op == "read" {
			c.ReadErrors++
		} else {
			c.WriteErrors++
		}
		c.LastError = f
	}
}

// snapshot returns the counts of every image together, and of each image
// by path, as of one moment.
func (l *errorLog) snapshot() (ErrorCounts, map[string]ErrorCounts) {
	l.mu.Lock()
	defer l.mu.Unlock()
	each := make(map[string]ErrorCounts, len(l.images))
	for p, c := range l.images {
		each[p] = *c
	}
	return l.total, each
}
