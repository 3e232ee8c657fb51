package main

import (
	"errors"
	"path/filepath"
	"sort"
	"strings"
	"syscall"

	"github.com/qcowfs/qcowfs/fs"
	"github.com/qcowfs/qcowfs/internal/remotefile"
	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/remote"
)

// A refusalLister knows which images a mount does not show, and why:
// image path (as opened, under the source) -> the error the library
// returned, so that the command can name the flag that lifts each
// (errors.Is(err, qcow2.ErrLocked), errors.As(err, **qcow2.RefusedError),
// ...). Refused blocks until the first scan of the source is complete,
// and is safe to call from any goroutine (qcowfs status calls it again
// later).
//
// The root node fs.NewRoot returns implements it; serve finds it by a type
// assertion.
type refusalLister interface {
	Refused() map[string]error
}

// A readOnlyLister knows which images a writable mount shows read-only,
// and why (with what would make them writable): image path -> reason.
// Call it after Refused, whose first scan opens every image.
//
// The root node implements it.
type readOnlyLister interface {
	ReadOnly() map[string]string
}

// readOnlyLines says, one line per image in path order, which image a
// writable mount shows read-only, and why: "shown read-only: PATH: why
// (what to do)".
func readOnlyLines(l readOnlyLister) []string {
	if l == nil {
		return nil
	}
	m := l.ReadOnly()
	paths := make([]string, 0, len(m))
	for p := range m {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	lines := make([]string, 0, len(paths))
	for _, p := range paths {
		lines = append(lines, "shown read-only: "+p+": "+m[p])
	}
	return lines
}

// A statsSource gives the tree's counters for qcowfs status: per image,
// requests, bytes, cache hit rates; any value encoding/json can print,
// under "images".
//
// The root node implements it.
type statsSource interface {
	Stats() any
}

// refusalLines says, one line per image in path order, which image is not
// shown, why, and what would show it.
func refusalLines(l refusalLister, hint func(error) string) []string {
	if l == nil {
		return nil
	}
	m := l.Refused()
	paths := make([]string, 0, len(m))
	for p := range m {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	lines := make([]string, 0, len(paths))
	for _, p := range paths {
		lines = append(lines, refusalLine(p, m[p], hint(m[p])))
	}
	return lines
}

func refusalLine(path string, err error, h string) string {
	msg := err.Error()
	if !strings.Contains(msg, path) {
		msg = path + ": " + msg
	}
	line := "not shown: " + msg
	if h != "" && !strings.Contains(msg, h) {
		line += " (" + h + ")"
	}
	return line
}

// refusalHint names the flag that would show an image refused with err,
// or "".
func refusalHint(err error) string {
	var re *qcow2.RefusedError
	switch {
	case errors.Is(err, qcow2.ErrLocked):
		return "--force-share"
	case errors.As(err, &re) && strings.Contains(re.Reason, "outside the allowed folders"):
		// "resolves to /srv/base/x.qcow2, outside the allowed
		// folders": name the folder to allow.
		dir := "DIR"
		if p, _, ok := strings.Cut(strings.TrimPrefix(re.Reason, "resolves to "), ", outside"); ok && filepath.IsAbs(p) {
			dir = filepath.Dir(p)
		}
		return "--allow-backing-outside=" + dir + " follows it"
	case errors.As(err, &re) && strings.Contains(re.Reason, "outside the allowed URL prefixes"):
		// "resolves to https://host/base/x.qcow2, outside the allowed
		// URL prefixes": name the URL's folder.
		prefix := "URL"
		if u, _, ok := strings.Cut(strings.TrimPrefix(re.Reason, "resolves to "), ", outside"); ok && remote.IsURL(u) {
			prefix = remotefile.Folder(u)
		}
		return "--allow-backing-outside=" + prefix + " follows it"
	case errors.Is(err, qcow2.ErrUnsupported) && strings.Contains(err.Error(), "corrupt"):
		return "--allow-corrupt"
	case errors.Is(err, qcow2.ErrBudget):
		return "--metadata-memory=SIZE gives image metadata more memory"
	case errors.As(err, new(*fs.BaseChangedError)):
		return "--accept-changed-base serves it anyway"
	case errors.Is(err, syscall.EDEADLK):
		// fs refused the daemon's own request on its mount.
		return "it lies inside the mount point, which the daemon cannot read from itself"
	}
	return ""
}

// refusalHint is the mount's refusalHint: a writable mount cannot share
// an image another process writes (--force-share is not for it).
func (c *mountCmd) refusalHint(err error) string {
	if c.Writable && errors.Is(err, qcow2.ErrLocked) {
		return ""
	}
	if h := keyHint(c.keys, err); h != "" {
		return h
	}
	return refusalHint(err)
}

// withHint adds refusalHint to err's message, keeping err wrapped.
func withHint(err error) error { return hintWith(err, refusalHint(err)) }

// hintWith adds the hint h, if any, to err's message, keeping err wrapped.
func hintWith(err error, h string) error {
	if h != "" && !strings.Contains(err.Error(), h) {
		return &hinted{err, h}
	}
	return err
}

type hinted struct {
	err  error
	hint string
}

func (h *hinted) Error() string { return h.err.Error() + " (" + h.hint + ")" }
func (h *hinted) Unwrap() error { return h.err }
