// Package remotefile joins package remote to the qcow2 library: a remote
// object as a qcow2.HostFile, and an Opener that opens the backing and data
// files a remote image names, as URLs resolved against the image's own URL
// and confined to the URL prefixes the user allowed. A remote image never
// gets a local file opened: names that do not resolve to an http://,
// https:// or s3:// URL are refused (remote.Resolve), and so is any
// image that is not itself a remote File.
package remotefile

import (
	"context"
	"fmt"
	"strings"

	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/remote"
)

// A File is a remote object open for the qcow2 library.
type File struct {
	*remote.Object
	url   string       // the URL as given (not redacted): the base of relative names
	close func() error // what Close does
}

var _ qcow2.HostFile = (*File)(nil)

// Open opens the object at url; closing the File closes it.
func Open(ctx context.Context, c *remote.Client, url string) (*File, error) {
	o, err := c.Open(ctx, url)
	if err != nil {
		return nil, err
	}
	return &File{Object: o, url: url, close: o.Close}, nil
}

// Shared returns a File over an Object that someone else keeps open
// (a mount keeps the objects it lists open, with their cached chunks);
// Close calls release instead of closing o.
func Shared(o *remote.Object, url string, release func()) *File {
	return &File{Object: o, url: url, close: func() error { release(); return nil }}
}

// Close closes the File (for a Shared one: releases it).
func (f *File) Close() error { return f.close() }

// Size returns the object's size, as it was when opened.
func (f *File) Size() (int64, error) { return f.Object.Size(), nil }

// Name is the object's redacted URL: it appears in messages.
func (f *File) Name() string { return f.Object.URL() }

// RawURL is the URL the File was opened with.
func (f *File) RawURL() string { return f.url }

// ID tells the objects of a backing chain apart, for loop detection.
func (f *File) ID() any { return "url:" + f.Object.URL() }

// An Opener opens backing and data files of remote images by URL.
type Opener struct {
	// OpenURL opens an allowed URL.
	OpenURL func(ctx context.Context, url string) (*File, error)
	// Allowed are the URL prefixes (remote.Within) that the files opened
	// must lie under: the mounted folder or prefix, and the
	// --allow-backing-outside URLs.
	Allowed []string
	// Ctx bounds the opens (each has the Client's timeout too); nil is
	// context.Background().
	Ctx context.Context
}

var _ qcow2.Opener = (*Opener)(nil)

// Open resolves name against the URL of image, checks that the result lies
// under an allowed prefix and opens it.
func (o *Opener) Open(image qcow2.HostFile, field, name string) (qcow2.HostFile, error) {
	refuse := func(reason string) error {
		return &qcow2.RefusedError{File: image.Name(), Field: field, Name: remote.Redact(name), Reason: reason}
	}
	rf, ok := image.(*File)
	if !ok {
		return nil, refuse("only remote images name remote files here")
	}
	u, err := remote.Resolve(rf.url, name)
	if err != nil {
		return nil, refuse(strings.TrimPrefix(err.Error(), remote.ErrBadURL.Error()+": "))
	}
	if !remote.Within(u, o.Allowed) {
		return nil, refuse(fmt.Sprintf("resolves to %s, outside the allowed URL prefixes", remote.Redact(u)))
	}
	ctx := o.Ctx
	if ctx == nil {
		ctx = context.Background()
	}
	return o.OpenURL(ctx, u)
}

// Folder returns the URL of the folder holding url: everything up to its
// last slash (of the path, not the query), with that slash.
func Folder(url string) string {
	s := url
	if i := strings.IndexAny(s, "?#"); i >= 0 {
		s = s[:i]
	}
	scheme := strings.Index(s, "://")
	if i := strings.LastIndexByte(s, '/'); i > scheme+2 {
		return s[:i+1]
	}
	return s + "/"
}

// IsPrefix reports whether the URL u names a prefix to list rather than
// one object: an s3:// URL that ends with a slash or names a bucket only.
// (Web servers have no listing: an http(s) URL always names one object.)
func IsPrefix(u string) bool {
	if len(u) < 5 || !strings.EqualFold(u[:5], "s3://") {
		return false
	}
	return strings.HasSuffix(u, "/") || !strings.Contains(strings.TrimSuffix(u[5:], "/"), "/")
}
