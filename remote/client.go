package remote

import (
	"context"
	"crypto/tls"
	"fmt"
	"net/http"
	"net/url"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/s3"
)

// A Client opens remote objects and holds what they share: the HTTP
// connections, the S3 client, the connection limit, the memory and disk
// chunk caches and the counters. It is safe for concurrent use.
type Client struct {
	opts    Options
	tlsConf *tls.Config
	http    *http.Client // for http:// and https://
	cache   *cache
	disk    *diskCache // nil without CacheDir
	conns   chan struct{}
	ahead   chan struct{} // prefetches' share of conns (fetch.go, acquire)
	st      counters

	// ctx ends with Close; every fetch runs under it.
	ctx    context.Context
	cancel context.CancelFunc

	s3mu  sync.Mutex // held while the S3 client is made
	s3api *s3.Client // made on first s3:// use; s3mu

	// Hydrations (hydrate.go): every one started, the disk cache bytes
	// they took, and when the rate cap lets the next bytes go.
	hydMu      sync.Mutex
	hydrations []*Hydration
	hydUsed    int64
	hydNext    time.Time
	hydBufs    sync.Pool // *[]byte of MaxRequest bytes: one hydration run's buffer

	mu      sync.Mutex
	ids     map[string]*idRef // cache ids by object identity
	objects map[*Object]struct{}
	nextID  uint64
	closed  bool
}

// idRef is the cache id of one object version, and how many Objects use it.
type idRef struct {
	id   uint64
	refs int
}

// NewClient checks opts, fills in defaults and opens the disk cache. It
// contacts no server: S3 configuration and credentials are loaded at the
// first s3:// Open or List.
func NewClient(ctx context.Context, opts Options) (*Client, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	tlsConf, err := tlsConfig(opts.CAFile)
	if err != nil {
		return nil, err
	}
	tr := &http.Transport{}
	tuneTransport(tr, opts.Connections, tlsConf, opts.StallTimeout)
	c := &Client{
		opts:    opts,
		tlsConf: tlsConf,
		http:    &http.Client{Transport: tr},
		cache:   newCache(opts.ChunkSize, opts.CacheSize),
		conns:   make(chan struct{}, opts.Connections),
		ahead:   make(chan struct{}, max(1, opts.Connections-2)),
		ids:     map[string]*idRef{},
		objects: map[*Object]struct{}{},
	}
	if opts.CacheDir != "" {
		if c.disk, err = openDiskCache(opts.CacheDir, opts.CacheDirSize, opts.Log); err != nil {
			return nil, err
		}
	}
	c.ctx, c.cancel = context.WithCancel(context.WithoutCancel(ctx))
	return c, nil
}

// Open opens the object at rawURL (http://, https://, or s3://BUCKET/KEY)
// for reading. Its first request, for the first chunk, learns the size and
// the version that every later request is pinned to, and proves that the
// server honours Range; a server that answers with the whole body is
// refused with ErrNoRange after reading none of it.
func (c *Client) Open(ctx context.Context, rawURL string) (*Object, error) {
	u, err := parseURL(rawURL)
	if err != nil {
		return nil, err
	}
	shown := redactURL(u)
	fail := func(err error) (*Object, error) {
		return nil, &Error{Op: "open", URL: shown, Off: -1, Err: err}
	}
	if c.opts.Offline {
		m, err := c.loadPin(u)
		if err != nil {
			return fail(err)
		}
		o, err := c.newObject(u, shown, offlineBackend{}, m)
		if err != nil {
			return fail(err)
		}
		return o, nil
	}
	ctx, cancel := context.WithTimeout(ctx, c.opts.Timeout)
	defer cancel()
	be, err := c.backend(ctx, u)
	if err != nil {
		return fail(err)
	}
	buf := make([]byte, c.opts.ChunkSize)
	var (
		m meta
		n int64
	)
	err = c.retry(ctx, nil, false, func(ctx context.Context) error {
		if err := c.acquire(ctx, false); err != nil {
			return err
		}
		defer c.release(false)
		var err error
		m, n, err = c.transfer(ctx, be, 0, [][]byte{buf}, nil, nil)
		return failFast(err)
	})
	if err != nil {
		return fail(err)
	}
	if m.etag == "" && m.lastModified == "" && m.versionID == "" {
		c.opts.Log.Warn("remote: the server gives no ETag or Last-Modified: a replaced object is only noticed if its size changes", "url", shown)
	}
	o, err := c.newObject(u, shown, be, m)
	if err != nil {
		return fail(err)
	}

	// Keep the first chunk: it holds the image's header (on disk too,
	// where a hydration finds it), and the version, which an offline
	// Client will find by the URL.
	if c.disk != nil {
		c.savePin(u, m)
		if n > 0 && n == int64(o.chunkLen(0)) {
			c.disk.put(o.diskKey, 0, buf[:n]) // (a failure is logged, once)
		}
	}
	if n > 0 {
		if s, res := c.cache.get(chunkKey{o.id, 0}); res == reserved {
			copy(s.buf, buf[:n])
			c.cache.finish(s, int(n), nil)
			s.unpin()
		} else if s != nil {
			s.unpin()
		}
	}
	return o, nil
}

// newObject makes the Object of version m of u (shown: redacted), read
// through be, sharing the cached chunks of any other Object of the same
// version.
func (c *Client) newObject(u *url.URL, shown string, be backend, m meta) (*Object, error) {
	o := &Object{c: c, be: be, url: shown, meta: m}
	o.nchunks = (m.size + c.opts.ChunkSize - 1) / c.opts.ChunkSize
	o.ctx, o.cancel = context.WithCancel(c.ctx)
	ident := identity(u, m)
	if c.disk != nil {
		o.diskKey = objectDir(ident, m.version(), m.size, c.opts.ChunkSize)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		o.cancel()
		return nil, ErrClosed
	}
	r := c.ids[ident]
	if r == nil {
		c.nextID++
		r = &idRef{id: c.nextID}
		c.ids[ident] = r
	}
	r.refs++
	o.id, o.ident = r.id, ident
	c.objects[o] = struct{}{}
	return o, nil
}

// identity names an object version for the caches: its URL without
// userinfo, its size and version. Two Opens of one version share chunks.
func identity(u *url.URL, m meta) string {
	c := *u
	c.User = nil
	return fmt.Sprintf("%s\x00%s\x00%d", c.String(), m.version(), m.size)
}

// backend returns the backend for u.
func (c *Client) backend(ctx context.Context, u *url.URL) (backend, error) {
	switch u.Scheme {
	case "http", "https":
		return &httpBackend{client: c.http, url: u}, nil
	case "s3":
		api, err := c.s3Client(ctx)
		if err != nil {
			return nil, err
		}
		key, err := s3Key(u)
		if err != nil {
			return nil, err
		}
		if key == "" {
			return nil, fmt.Errorf("%w: %s names a bucket, not an object", ErrBadURL, redactURL(u))
		}
		return &s3Backend{api: api, bucket: u.Host, key: key}, nil
	}
	return nil, fmt.Errorf("%w: scheme %q", ErrBadURL, u.Scheme)
}

// forget drops o's hold on its cache id; the last Object of a version
// frees its chunks for reuse.
func (c *Client) forget(o *Object) {
	c.mu.Lock()
	delete(c.objects, o)
	r := c.ids[o.ident]
	last := false
	if r != nil {
		r.refs--
		if r.refs == 0 {
			delete(c.ids, o.ident)
			last = true
		}
	}
	c.mu.Unlock()
	if last {
		c.cache.drop(o.id)
	}
}

// Stats returns the Client's counters, summed over all objects it opened.
func (c *Client) Stats() ClientStats {
	s := ClientStats{Stats: c.st.load()}
	s.CacheBuffers, s.CacheChunks = c.cache.stats()
	if c.disk != nil {
		s.DiskBytes = c.disk.usage()
	}
	c.mu.Lock()
	s.Objects = len(c.objects)
	c.mu.Unlock()
	if hs := c.Hydrations(); len(hs) > 0 {
		s.Hydration = hs
	}
	s.Offline = c.opts.Offline
	return s
}

// Options returns the options in force, defaults filled in.
func (c *Client) Options() Options { return c.opts }

// Close closes every Object of the Client and ends its fetches. Reads in
// progress fail with ErrClosed.
func (c *Client) Close() error {
	c.mu.Lock()
	c.closed = true
	objs := make([]*Object, 0, len(c.objects))
	for o := range c.objects {
		objs = append(objs, o)
	}
	c.mu.Unlock()
	for _, o := range objs {
		o.Close()
	}
	c.cancel()
	c.http.CloseIdleConnections()
	return nil
}
