package remote

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"time"
)

// Offline (Options.Offline): objects served from the disk cache alone,
// while their server is down or out of reach. Every Open with a disk
// cache records, beside the chunks, the version it pinned for the URL
// (a pin: size, ETag, Last-Modified, S3 version id, chunk size), which
// is what names the version's chunks (objectDir). An offline Client
// sends no request: Open takes the URL's pin instead of asking the
// server, so its chunks are found where the online mounts put them; a
// read of a chunk the disk cache does not hold fails with ErrOffline
// (logged once per Object), and listing a prefix is refused (no listing
// is kept). A version once hydrated whole (Object.Hydrate) reads whole.

// ErrOffline: the Client is offline (Options.Offline) and what was asked
// needs the server: a chunk the disk cache does not hold, a URL it has no
// pin for, a listing.
var ErrOffline = errors.New("offline")

// pinsDir is the folder of the pins, beside the chunks' folder.
const pinsDir = "qcowfs-remote-v1-pins"

// A pin is the version an online Open of a URL pinned, as stored.
type pin struct {
	URL          string    `json:"url"` // redacted, for people reading the file
	Size         int64     `json:"size"`
	ETag         string    `json:"etag,omitempty"`
	LastModified string    `json:"last-modified,omitempty"`
	VersionID    string    `json:"version-id,omitempty"`
	ChunkSize    int64     `json:"chunk-size"`
	Opened       time.Time `json:"opened"`
}

// pinPath is where the pin of the URL u (without userinfo) lives.
func (c *Client) pinPath(u *url.URL) string {
	v := *u
	v.User = nil
	h := sha256.Sum256([]byte(v.String()))
	return filepath.Join(c.opts.CacheDir, pinsDir, hex.EncodeToString(h[:16]))
}

// savePin records m as the version of u the disk cache holds chunks of.
// A failure is logged and otherwise ignored: only an offline mount needs
// pins.
func (c *Client) savePin(u *url.URL, m meta) {
	p := pin{URL: redactURL(u), Size: m.size, ETag: m.etag, LastModified: m.lastModified, VersionID: m.versionID,
		ChunkSize: c.opts.ChunkSize, Opened: time.Now().UTC()}
	b, _ := json.Marshal(p)
	path := c.pinPath(u)
	err := os.MkdirAll(filepath.Dir(path), 0o700)
	if err == nil {
		err = writeFileAtomic(path, b)
	}
	if err != nil {
		c.opts.Log.Warn("remote: cannot record the version opened in the disk cache; an offline mount will not find it", "url", p.URL, "err", err)
	}
}

// writeFileAtomic writes b to path through a temporary file renamed into
// place.
func writeFileAtomic(path string, b []byte) error {
	f, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".*.tmp")
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	if err != nil {
		os.Remove(f.Name())
	}
	return err
}

// loadPin returns the version of u an online Open recorded.
func (c *Client) loadPin(u *url.URL) (meta, error) {
	dir := c.opts.CacheDir
	b, err := os.ReadFile(c.pinPath(u))
	if errors.Is(err, os.ErrNotExist) {
		return meta{}, fmt.Errorf("%w: the disk cache %s holds no version of it (mount it once with the server up and this cache folder)", ErrOffline, dir)
	}
	if err != nil {
		return meta{}, fmt.Errorf("%w: the disk cache's record of it: %w", ErrOffline, err)
	}
	var p pin
	if err := json.Unmarshal(b, &p); err != nil || p.Size < 0 {
		return meta{}, fmt.Errorf("%w: the disk cache's record of it, %s, is damaged", ErrOffline, c.pinPath(u))
	}
	if p.ChunkSize != c.opts.ChunkSize {
		return meta{}, fmt.Errorf("%w: the disk cache %s holds it in chunks of %d bytes, not %d (mount with --remote-chunk-size=%d)", ErrOffline, dir, p.ChunkSize, c.opts.ChunkSize, p.ChunkSize)
	}
	return meta{size: p.Size, etag: p.ETag, lastModified: p.LastModified, versionID: p.VersionID}, nil
}

// offlineMiss is the failure of an offline fetch of len(bufs) bytes at
// off: what the reads did not find in the disk cache (they look there
// first). Object.fetch returns it without sending or counting a request.
func offlineMiss(off int64, bufs [][]byte) error {
	var n int64
	for _, b := range bufs {
		n += int64(len(b))
	}
	return fmt.Errorf("%w: bytes %d to %d are not in the disk cache", ErrOffline, off, off+n-1)
}

// offlineBackend is the backend of an offline Client's Objects, which
// never ask it (Object.fetch).
type offlineBackend struct{}

func (offlineBackend) get(ctx context.Context, off, n int64, pin *meta) (io.ReadCloser, meta, error) {
	return nil, meta{}, fmt.Errorf("%w: bytes %d to %d are not in the disk cache", ErrOffline, off, off+n-1)
}

// noteOffline logs, once per Object, that a read needed chunks the disk
// cache does not hold.
func (o *Object) noteOffline(off int64, err error) {
	if o.offlineNoted.CompareAndSwap(false, true) {
		o.c.opts.Log.Warn("remote: offline, and a read needs chunks the disk cache does not hold; such reads fail (EIO)",
			"url", o.url, "version", o.meta.version(), "offset", off, "err", err)
	}
}
