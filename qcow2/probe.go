package qcow2

import (
	"encoding/binary"
	"errors"
	"io"
	"os"
)

// Small entry points for callers that have no image to read: the format
// probe, which inflater this build has, lock probing for reports that
// take no lock, and qemu's locks on a raw file.

// ProbeSize is how many of a file's first bytes Probe looks at.
const ProbeSize = 8

// Probe reports whether qemu takes a file whose first bytes are head
// (fewer than ProbeSize if the file is that short) for a qcow2 image, as
// its format probe (block/qcow2.c, qcow2_probe) decides: the magic, and a
// version (bytes 4-7) other than 0. qemu probes a buffer that reads as
// zeros past the end of the file, so a file holding the magic alone has
// version 0 and is a raw image to qemu. (Version 1 is qemu's older qcow
// format, which Open refuses, naming the version.)
func Probe(head []byte) bool {
	var b [ProbeSize]byte
	copy(b[:], head)
	return binary.BigEndian.Uint32(b[:4]) == Magic && binary.BigEndian.Uint32(b[4:]) != 0
}

// ProbeFile reads f's first bytes and Probes them.
func ProbeFile(f io.ReaderAt) (bool, error) {
	var b [ProbeSize]byte
	n, err := f.ReadAt(b[:], 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return false, err
	}
	return Probe(b[:n]), nil
}

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
