package guestfs

import (
	"errors"
	"fmt"
	"io"
	"sync"
)

// ErrNoFS: no signature of any file system (or volume format) this
// package knows of.
var ErrNoFS = errors.New("no file system signature")

// UnsupportedError names a file system, or a feature of one, that is not
// read: XFS, btrfs, NTFS, swap, a LUKS or LVM volume, ... (Type is blkid's
// name for it). It wraps ErrUnsupported.
type UnsupportedError struct {
	Type string
	Msg  string
}

func (e *UnsupportedError) Error() string { return e.Type + ": " + e.Msg }

func (e *UnsupportedError) Unwrap() error { return ErrUnsupported }

// An Opener opens the file system in r, size bytes long, which Probe has
// named.
type Opener func(r io.ReaderAt, size int64) (FS, error)

var (
	openersMu sync.RWMutex
	openers   = map[string]Opener{}
)

// Register makes Open hand the file systems Probe names typ to open. The
// readers register themselves when imported: guestfs/ext4 for "ext2",
// "ext3" and "ext4", guestfs/fat for "vfat". A program imports the ones it
// wants, for their side effect if it calls nothing else of them:
//
//	import (
//		_ "github.com/qcowfs/qcowfs/guestfs/ext4"
//		_ "github.com/qcowfs/qcowfs/guestfs/fat"
//	)
func Register(typ string, open Opener) {
	openersMu.Lock()
	defer openersMu.Unlock()
	if _, dup := openers[typ]; dup {
		panic("guestfs: Register called twice for " + typ)
	}
	openers[typ] = open
}

// Open opens the file system in r (a partition, or a disk without a
// partition table), size bytes long: Probe names it, and the reader
// registered for that name opens it. A file system no reader is registered
// for is an *UnsupportedError naming it; bytes that hold no known
// signature are ErrNoFS.
func Open(r io.ReaderAt, size int64) (FS, error) {
	typ, err := Probe(r, size)
	if err != nil {
		return nil, err
	}
	openersMu.RLock()
	open := openers[typ]
	openersMu.RUnlock()
	if open == nil {
		msg := "not read by qcowfs"
		if why, ok := unsupportedWhy[typ]; ok {
			msg = fmt.Sprintf("%s: %s", msg, why)
		}
		return nil, &UnsupportedError{Type: typ, Msg: msg}
	}
	return open(r, size)
}
