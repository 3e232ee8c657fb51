// Package remote reads objects over HTTP(S) and from S3 as io.ReaderAts,
// with ranged requests, for qcowfs to open qcow2 images (and their backing
// and data files) that live on a web server or in a bucket. It owns the
// transport: URLs, requests, retries, version pinning, the chunk caches and
// the counters. It knows nothing of qcow2 or FUSE; the qcow2 library gets
// Objects through its injectable opener, and fs/ lists buckets with List.
//
// # API
//
//	c, err := remote.NewClient(ctx, remote.Options{...})  // one per daemon
//	o, err := c.Open(ctx, "https://host/vm.qcow2")        // or s3://bucket/key
//	n, err := o.ReadAt(p, off)                            // io.ReaderAt
//	o.Size(), o.URL(), o.Version(), o.Stats(), o.Close()
//	entries, err := c.List(ctx, "s3://bucket/prefix/")
//	remote.IsURL(s), remote.Resolve(imageURL, backingName), remote.Within(url, prefixes)
//
// HTTP(S) goes through net/http (Go's transport, a CA file added to the
// system pool); S3 through the AWS SDK for Go v2, with its standard
// credential chain, Options.S3Endpoint for S3-compatible stores (path-style
// unless S3VirtualHost; with an endpoint the instance metadata service is
// never asked for credentials) and Options.S3Region. The SDK's own log
// lines go to Options.Log.
//
// # Versions
//
// Open's request, for the first chunk, learns the object's size and
// version: the ETag, the S3 version id in a versioned bucket, or (with a
// weak or no ETag) the Last-Modified time. Every later request is
// conditional on it (If-Match, VersionId, If-Unmodified-Since), and its
// response is checked again (Content-Range total, ETag, version id), for
// servers that ignore conditions. Any sign of another version (a 412, a new
// size, ETag or version id, a 404) fails the read with ErrChanged, logs one
// line, and fails every later read of the Object too: a reader never gets
// bytes of two versions. Note that nginx's ETag is the file's mtime and
// size; a file rewritten within the same second at the same size keeps it.
//
// # Ranges
//
// Every response must be a 206 with exactly the range asked for. A 200
// (the whole body) fails with ErrNoRange at once, at Open or any read,
// and its body is closed unread, which closes the connection: at most
// what is already in flight is received.
//
// # Failures and time
//
// Every Open, List and ReadAt has Options.Timeout. Transient failures
// (refused or reset connections, a body cut short, a short body, a stall
// of StallTimeout with no byte, HTTP 5xx and 429, S3 SlowDown and other
// throttling codes) are retried with exponential backoff and jitter
// (honouring Retry-After), resuming a cut body where it stopped; what
// cannot complete in time fails with an error wrapping ErrTimeout and the
// last failure. Other failures are not retried: ErrAuth (401, 403, a wrong
// S3 key or signature), ErrNotFound, TLS verification and handshake
// errors, unexpected statuses. Open and List, the first requests to a
// server, do not retry a server that cannot be reached either (the
// connection refused, no route, a name that does not resolve): they fail
// at once with the cause. An Object whose read timed out is down
// (health.go): its reads that need the server fail at once, wrapping
// ErrTimeout, until a probe (a one-byte request, with backoff) finds the
// server answering again. Errors are *Error values naming the operation, the redacted
// URL, the offset and length, and the cause with its values (status and
// S3 code, sizes, ETags). Credentials never appear in errors or logs:
// URLs are shown through Redact (no userinfo, no signature or token
// query values), S3 errors are rebuilt from status, code and message, and
// no header is logged.
//
// # Caching
//
// Objects are read in chunks of Options.ChunkSize through one memory cache
// per Client (cache.go: a fixed array of CacheSize/ChunkSize slots whose
// buffers are allocated once and reused, CLOCK eviction, one fetch per
// chunk however many readers want it), and optionally a disk cache
// (diskcache.go: one checksummed file per chunk, keyed by URL and version,
// bounded by CacheDirSize, least recently used first out). Two Objects
// open on the same version share cached chunks. A read spanning several
// missing chunks fetches them at once: adjacent ones in one request of up
// to MaxRequest bytes, the others in parallel; at most Connections
// requests are in flight per Client. When every slot is pinned by readers,
// a read goes around the cache into the caller's buffer rather than wait.
//
// # Readahead
//
// Each Object detects sequential readers (readahead.go) and prefetches
// ahead of them from their third read on, a window that starts at one
// chunk and doubles up to MaxReadahead; random readers cause no prefetch.
// Prefetches wait for a connection, but hold at most Connections-2 of them
// together, so that demand reads always find one soon.
//
// # Hydration
//
// Object.Hydrate fetches byte ranges the caller names (for a qcow2 image,
// its metadata and data clusters: qcow2.Image.HostRanges) into the disk
// cache in the background, lowest offsets first, in runs of up to
// MaxRequest, on the prefetches' share of the connections, under
// Options.HydrateRate, bounded by CacheDirSize (hydrate.go). Chunks in
// the disk cache already (a later Client of the same version) are not
// fetched again. A chunk the disk cache cannot store (a full file
// system) fails the hydration; only chunks stored count as done.
// Client.Stats lists each hydration's progress.
//
// # Offline
//
// Every Open with a disk cache records the version it pinned for the URL
// beside the chunks (a pin). An offline Client (Options.Offline) sends no
// request: Open takes the URL's pin, reads find the version's chunks in
// the disk cache, and what it does not hold fails with ErrOffline, logged
// once per Object (offline.go).
//
// # Counters
//
// Object.Stats and Client.Stats count requests, bytes, retries, cache hits
// and misses, disk hits, waits, prefetches and errors, for tests and for
// the daemon's status.
package remote
