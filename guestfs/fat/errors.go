package fat

import (
	"errors"
	"fmt"

	"github.com/qcowfs/qcowfs/guestfs"
)

// fsType is the type Linux mounts these file systems as, and the FS of
// every FormatError here.
const fsType = "vfat"

func withMsg(e *guestfs.FormatError, format string, args ...any) *guestfs.FormatError {
	e.Msg = fmt.Sprintf(format, args...)
	return e
}

// withInode names ino in a FormatError that names no inode yet (one from
// the FAT or a chain, which know no inode).
func withInode(err error, ino uint64) error {
	var fe *guestfs.FormatError
	if errors.As(err, &fe) && fe.Inode == 0 {
		c := *fe
		c.Inode = ino
		return &c
	}
	return err
}
