package remote

import (
	"errors"
	"fmt"
)

// Sentinel errors. Every error this package returns is an *Error that wraps
// one of these where it applies, so callers (the FUSE layer maps all of them
// to EIO) and tests tell them apart with errors.Is.
var (
	// ErrChanged: the object is no longer the version first seen (a 412 to
	// If-Match, another ETag, size or version id, or the object is gone).
	// Every read of the Object fails with it from then on.
	ErrChanged = errors.New("remote object changed while open")
	// ErrNoRange: the server answered a range request with the whole body.
	ErrNoRange = errors.New("server ignores Range requests")
	// ErrTimeout: the operation could not complete within Options.Timeout.
	ErrTimeout = errors.New("remote operation timed out")
	// ErrAuth: the server refused the credentials (401, 403, a bad S3 key or
	// signature), or none could be found.
	ErrAuth = errors.New("remote access denied")
	// ErrNotFound: there is no object at the URL (at Open).
	ErrNotFound = errors.New("remote object not found")
	// ErrClosed: the Object or Client was closed.
	ErrClosed = errors.New("remote object closed")
	// ErrBadURL: the URL is not http://, https:// or s3://bucket/key, or a
	// name does not resolve to one.
	ErrBadURL = errors.New("bad remote URL")
)

// An Error says which operation on which object failed, and why. URL is
// always redacted (see Redact): no credentials ever reach an error message.
type Error struct {
	Op  string // "open", "read", "list"
	URL string // redacted
	Off int64  // the read's offset, or -1
	Len int64  // the read's length, or 0
	Err error
}

func (e *Error) Error() string {
	if e.Off >= 0 {
		return fmt.Sprintf("remote: %s %s [offset %d, %d bytes]: %v", e.Op, e.URL, e.Off, e.Len, e.Err)
	}
	return fmt.Sprintf("remote: %s %s: %v", e.Op, e.URL, e.Err)
}

func (e *Error) Unwrap() error { return e.Err }

// StatusError is an HTTP status the operation did not expect. S3 errors
// carry the S3 error code too.
type StatusError struct {
	Code    int
	S3Code  string // e.g. "SlowDown", "SignatureDoesNotMatch"; "" for plain HTTP
	Message string // the server's message, if short; never a header value
}

func (e *StatusError) Error() string {
	s := fmt.Sprintf("status %d", e.Code)
	if e.S3Code != "" {
		s += " " + e.S3Code
	}
	if e.Message != "" {
		s += ": " + e.Message
	}
	return s
}

// transientError marks a failure worth retrying: a reset or refused
// connection, a stall, a short body, a 5xx, 429 or S3 throttling.
type transientError struct{ err error }

func (e *transientError) Error() string { return e.err.Error() }
func (e *transientError) Unwrap() error { return e.err }

func transient(err error) error { return &transientError{err} }

func isTransient(err error) bool {
	var t *transientError
	return errors.As(err, &t)
}

// errDropped marks a chunk fetch that was abandoned without a verdict on
// the data (a prefetch that found no free connection, a fetch cancelled
// because its Object closed). A reader waiting for that chunk fetches it
// itself.
var errDropped = errors.New("chunk fetch dropped")
