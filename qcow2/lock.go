package qcow2

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/internal/procinfo"
)

// Image locking, as qemu's file driver does it (block/file-posix.c), so
// that qcowfs and qemu see each other.
//
// qemu holds shared open-file-description (OFD) locks on single bytes of
// every image file it opens: byte 100+i while it holds permission i, byte
// 200+i while it refuses to share permission i, with the permissions 0
// consistent-read, 1 write, 2 write-unchanged, 3 resize. Before taking a
// permission it checks that nobody locks the matching 200+i byte, and
// before refusing to share one that nobody locks 100+i. A read-only
// reader, like qemu-img info without -U, holds consistent-read and does
// not share write: it locks bytes 100 and 201, and cannot open an image
// whose byte 101 is locked by a writer.

const (
	lockPermBase   = 100
	lockSharedBase = 200
	permConsistent = 0
	permWrite      = 1
)

var permNames = [...]string{"consistent read", "write", "write unchanged", "resize"}

// Lock takes the locks of a read-only qemu reader on every file of the
// chain: consistent read (byte 100) and, unless share is set, "does not
// share write" (byte 201), after checking that no other process writes the
// image (byte 101) or refuses to share reading (byte 200). With share set
// (qemu-img -U), nothing is checked and only byte 100 is locked. The locks
// last until Close.
func (img *Image) Lock(share bool) error {
	for l := img.top; l != nil; l = l.backing {
		for _, hf := range []HostFile{l.file, l.dataFile} {
			f := fileOf(hf)
			if f == nil {
				continue // no file, no lock (remote objects, test buffers)
			}
			if err := lockFile(f, share); err != nil {
				return err
			}
			if hf == img.top.file {
				img.noteLocked(true, lockPermBase+permConsistent)
				if !share {
					img.noteLocked(true, lockSharedBase+permWrite)
				}
			}
		}
	}
	return nil
}

// noteLocked records that the image holds (or no longer holds) lock bytes
// on its file.
func (img *Image) noteLocked(held bool, bytes ...int64) {
	var bits uint32
	for _, b := range bytes {
		bits |= 1 << (b%100 + 8*(b/100-1))
	}
	if held {
		img.locked.Or(bits)
	} else {
		img.locked.And(^bits)
	}
}

// Locks are the qemu locks an image holds on its file, by qemu's names of
// the permissions (block/file-posix.c): those it takes (byte 100+i) and
// those it does not let others take (byte 200+i).
type Locks struct {
	Held      []string `json:"held"`
	NotShared []string `json:"not-shared"`
}

// Locks returns the locks the image holds on its file now (those Lock and
// LockWrite took, and Unlock and UnlockWrite have not dropped).
func (img *Image) Locks() Locks {
	bits := img.locked.Load()
	l := Locks{Held: []string{}, NotShared: []string{}}
	for i, name := range permNames {
		if bits&(1<<i) != 0 {
			l.Held = append(l.Held, name)
		}
		if bits&(1<<(8+i)) != 0 {
			l.NotShared = append(l.NotShared, name)
		}
	}
	return l
}

func lockFile(f *os.File, share bool) error {
	if !share {
		// We want consistent read: nobody may refuse to share it.
		if err := testLock(f, lockSharedBase+permConsistent); err != nil {
			return err
		}
		// We do not share write: nobody may hold it.
		if err := testLock(f, lockPermBase+permWrite); err != nil {
			return err
		}
	}
	if err := setLock(f, lockPermBase+permConsistent); err != nil {
		return err
	}
	if !share {
		return setLock(f, lockSharedBase+permWrite)
	}
	return nil
}

// testLock fails with a LockError if another open file description holds
// a lock on byte off.
func testLock(f *os.File, off int64) error {
	lk := unix.Flock_t{Type: unix.F_WRLCK, Whence: 0, Start: off, Len: 1}
	if err := unix.FcntlFlock(f.Fd(), unix.F_OFD_GETLK, &lk); err != nil {
		return fmt.Errorf("%s: testing lock byte %d: %w", f.Name(), off, err)
	}
	if lk.Type == unix.F_UNLCK {
		return nil
	}
	return lockError(f, off)
}

// lockError says that another open file description locks byte off of f,
// naming its process where /proc tells (an OFD lock's pid reads -1).
func lockError(f *os.File, off int64) *LockError {
	e := &LockError{File: f.Name(), Perm: permNames[(off-lockPermBase)%100], Byte: off}
	if p, ok := procinfo.LockHolder(f, off); ok {
		e.Holder = p.String()
	}
	return e
}

// setLock takes a shared lock on byte off.
func setLock(f *os.File, off int64) error {
	lk := unix.Flock_t{Type: unix.F_RDLCK, Whence: 0, Start: off, Len: 1}
	if err := unix.FcntlFlock(f.Fd(), unix.F_OFD_SETLK, &lk); err != nil {
		if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EACCES) {
			return lockError(f, off)
		}
		return fmt.Errorf("%s: locking byte %d: %w", f.Name(), off, err)
	}
	return nil
}

// Unlock drops every lock Lock took, as qemu does when its last user of an
// image lets go. The image stays open.
func (img *Image) Unlock() {
	img.noteLocked(false, lockPermBase+permConsistent, lockSharedBase+permWrite)
	for l := img.top; l != nil; l = l.backing {
		for _, hf := range []HostFile{l.file, l.dataFile} {
			if f := fileOf(hf); f != nil {
				for _, off := range []int64{lockPermBase + permConsistent, lockSharedBase + permWrite} {
					lk := unix.Flock_t{Type: unix.F_UNLCK, Whence: 0, Start: off, Len: 1}
					unix.FcntlFlock(f.Fd(), unix.F_OFD_SETLK, &lk)
				}
			}
		}
	}
}

const permResize = 3

// LockWrite adds, on the image file and its data file, the locks of a
// qemu that writes the image: the write and resize permissions (bytes 101
// and 103), and refusing to share them (201, 203), after checking that no
// other process holds or refuses them. Backing files keep their reader's
// locks. Lock must have been called first; UnlockWrite undoes this.
func (img *Image) LockWrite() error {
	l := img.top
	for _, hf := range []HostFile{l.file, l.dataFile} {
		f := fileOf(hf)
		if f == nil {
			continue
		}
		for _, b := range []int64{lockSharedBase + permWrite, lockSharedBase + permResize,
			lockPermBase + permWrite, lockPermBase + permResize} {
			if err := testLock(f, b); err != nil {
				return err
			}
		}
		for _, b := range []int64{lockPermBase + permWrite, lockPermBase + permResize, lockSharedBase + permResize} {
			if err := setLock(f, b); err != nil {
				img.UnlockWrite()
				return err
			}
		}
		if hf == l.file {
			img.noteLocked(true, lockPermBase+permWrite, lockPermBase+permResize, lockSharedBase+permResize)
		}
	}
	return nil
}

// UnlockWrite drops the locks LockWrite added, keeping a reader's.
func (img *Image) UnlockWrite() {
	img.noteLocked(false, lockPermBase+permWrite, lockPermBase+permResize, lockSharedBase+permResize)
	l := img.top
	for _, hf := range []HostFile{l.file, l.dataFile} {
		if f := fileOf(hf); f != nil {
			for _, off := range []int64{lockPermBase + permWrite, lockPermBase + permResize, lockSharedBase + permResize} {
				lk := unix.Flock_t{Type: unix.F_UNLCK, Whence: 0, Start: off, Len: 1}
				unix.FcntlFlock(f.Fd(), unix.F_OFD_SETLK, &lk)
			}
		}
	}
}

// Chain returns the files of the image's backing chain below it (backing
// files, in order), for a caller that must know which files the image
// reads (and so must not write).
func (img *Image) Chain() []HostFile {
	var out []HostFile
	for l := img.top.backing; l != nil; l = l.backing {
		out = append(out, l.file)
	}
	return out
}

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
