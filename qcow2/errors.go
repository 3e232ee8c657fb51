package qcow2

import (
	"errors"
	"fmt"
)

// Sentinel errors; test for them with errors.Is.
var (
	// ErrNotQcow2 means the file does not start with the qcow2 magic.
	ErrNotQcow2 = errors.New("not a qcow2 image")
	// ErrCorrupt means the image's metadata is malformed. Every
	// *FormatError wraps it.
	ErrCorrupt = errors.New("corrupt image")
	// ErrUnsupported means the image is well formed but uses a feature
	// this package cannot read (an unknown incompatible feature, a
	// cipher package luks does not implement, ...).
	ErrUnsupported = errors.New("unsupported image")
	// ErrRefused means a backing or data file reference was refused by
	// policy (a protocol prefix, a path outside the allowed folders, a
	// loop in the chain, ...).
	ErrRefused = errors.New("refused")
	// ErrLocked means another process holds one of qemu's image locks
	// that this one conflicts with. Every *LockError wraps it.
	ErrLocked = errors.New("image is locked")
	// ErrNoData is returned by NextData when there is no data at or
	// after the offset (lseek's ENXIO).
	ErrNoData = errors.New("no data after offset")
	// ErrShortRead is wrapped by the error of a read that got fewer
	// bytes than the file held when it was opened: the file shrank
	// under us.
	ErrShortRead = errors.New("short read: the file is shorter than when it was opened")
	// ErrBudget means a structure of the image does not fit in the memory
	// budget (Options.Budget). Every *BudgetError wraps it.
	ErrBudget = errors.New("over the memory budget")
	// ErrWalkBudget is wrapped by the error of a walk that ran out of work
	// before it could answer.
	ErrWalkBudget = errors.New("the walk ran out of its work budget")
	// ErrNotEncrypted is returned by DescribeEncrypted for an image that is
	// not encrypted: open it with Open.
	ErrNotEncrypted = errors.New("not encrypted")
	// ErrReadOnly is wrapped by the error of a write to an image that is not
	// open for writing, or stopped being writable.
	ErrReadOnly = errors.New("image is read-only")
	// ErrNoSpace is returned for writes past the end of the virtual disk.
	ErrNoSpace = errors.New("write past the end of the disk")
	// ErrNoBitmap is wrapped by the error of a view of a persistent
	// bitmap the image does not have.
	ErrNoBitmap = errors.New("no such bitmap")
	// ErrKey is wrapped by the error of an encrypted image that could not
	// be unlocked: no passphrase, or a wrong one (KeyError).
	ErrKey = errors.New("cannot unlock the encryption key")
	// ErrOverlap is wrapped by the error of a write refused because it would
	// have landed on the image's metadata.
	ErrOverlap = errors.New("write would overwrite metadata")
)

// A FormatError reports a malformed field: which file, which field (named as
// in the specification), the value found, and the byte offset where it was
// read. It wraps ErrCorrupt.
type FormatError struct {
	File   string // path of the image file
	Field  string // e.g. "l1_table_offset", "L2 entry"
	Value  uint64 // the offending value
	Offset int64  // byte offset of the field in File; -1 if not from disk
	Msg    string // what is wrong with it
}

func (e *FormatError) Error() string {
	if e.Offset < 0 {
		return fmt.Sprintf("%s: %s = %#x: %s", e.File, e.Field, e.Value, e.Msg)
	}
	return fmt.Sprintf("%s: %s = %#x at byte offset %d: %s", e.File, e.Field, e.Value, e.Offset, e.Msg)
}

func (e *FormatError) Unwrap() error { return ErrCorrupt }

// An UnsupportedError names a feature the image needs that this package
// cannot provide. It wraps ErrUnsupported.
type UnsupportedError struct {
	File    string
	Feature string
}

func (e *UnsupportedError) Error() string {
	return fmt.Sprintf("%s: %s: not supported", e.File, e.Feature)
}

func (e *UnsupportedError) Unwrap() error { return ErrUnsupported }

// A RefusedError reports a backing or data file reference that policy does
// not allow. It wraps ErrRefused.
type RefusedError struct {
	File   string // the image holding the reference
	Field  string // "backing file" or "data file"
	Name   string // the reference as stored in the image
	Reason string
}

func (e *RefusedError) Error() string {
	return fmt.Sprintf("%s: %s %q refused: %s", e.File, e.Field, e.Name, e.Reason)
}

func (e *RefusedError) Unwrap() error { return ErrRefused }

// A LockError says which lock of which file another process holds, and
// who that is where /proc tells.
type LockError struct {
	File string
	Perm string // the permission: "write", "consistent read", ...
	Byte int64  // the locked byte
	// Holder names the process holding it: "qemu-system-x86_64 (pid
	// 4242)", "another qcowfs (pid 4242, mounted at /mnt/vms)"; "" if
	// unknown.
	Holder string
}

func (e *LockError) Error() string {
	who := e.Holder
	if who == "" {
		who = "another process (qemu?)"
	}
	if e.Byte >= lockSharedBase {
		return fmt.Sprintf("%s: %s does not share %q access (it locks byte %d): not served while it has the image open", e.File, who, e.Perm, e.Byte)
	}
	return fmt.Sprintf("%s: in use by %s holding the %q lock (byte %d): not served while it has the image open for writing", e.File, who, e.Perm, e.Byte)
}

func (e *LockError) Unwrap() error { return ErrLocked }

// A BudgetError reports a structure that does not fit in the memory budget.
// It wraps ErrBudget.
type BudgetError struct {
	File  string
	What  string // the structure
	Need  int64  // bytes it needs
	Held  int64  // bytes the file holds already
	Limit int64  // the budget's size
}

func (e *BudgetError) Error() string {
	return fmt.Sprintf("%s: %s needs %d bytes of memory, more than the budget of %d bytes allows (this image holds %d already)",
		e.File, e.What, e.Need, e.Limit, e.Held)
}

func (e *BudgetError) Unwrap() error { return ErrBudget }

// A ReadOnlyError says why an image opened for writing is read-only.
type ReadOnlyError struct {
	File   string
	Reason string
}

func (e *ReadOnlyError) Error() string { return fmt.Sprintf("%s: read-only: %s", e.File, e.Reason) }
func (e *ReadOnlyError) Unwrap() error { return ErrReadOnly }

// A KeyError says why an encrypted image cannot be opened: no passphrase
// was given for it, or the one given opens none of its key slots. It wraps
// ErrKey.
type KeyError struct {
	File    string
	Missing bool // no passphrase given (else a wrong one)
}

func (e *KeyError) Error() string {
	if e.Missing {
		return fmt.Sprintf("%s: encrypted: no key given", e.File)
	}
	return fmt.Sprintf("%s: encrypted: wrong passphrase", e.File)
}

func (e *KeyError) Unwrap() error { return ErrKey }
