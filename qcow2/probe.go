package qcow2

import (
	"os"
)

// Small entry points for callers that have no image to read: which
// inflater this build has, lock probing for reports that take no lock,
// and qemu's locks on a raw file.

// Libdeflate reports whether this build inflates deflate-compressed
// clusters with libdeflate (cgo) rather than compress/flate.
func Libdeflate() bool { return haveLibdeflate }

// LockConflict reports, without taking any lock, what Lock(false) would
// refuse: a LockError if another process (a running qemu) has a file of
// the chain open for writing or refuses to share reading it, nil
// otherwise. It lets a caller that holds no locks (a listing, a report of
// refused images) say why an image would not be served.
func (img *Image) LockConflict() error {
	for l := img.top; l != nil; l = l.backing {
		for _, hf := range []HostFile{l.file, l.dataFile} {
			f := fileOf(hf)
			if f == nil {
				continue
			}
			if err := testLock(f, lockSharedBase+permConsistent); err != nil {
				return err
			}
			if err := testLock(f, lockPermBase+permWrite); err != nil {
				return err
			}
		}
	}
	return nil
}

// LockFile takes a read-only qemu reader's locks on a file that is not
// opened as an Image (a raw disk), as Lock does for every file of a chain.
// The locks last until f is closed.
func LockFile(f *os.File, share bool) error { return lockFile(f, share) }
