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
	// this package cannot read (encryption, an unknown incompatible
	// feature, ...).
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
