package remote

import (
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
)

// Options configures a Client. The zero value of each field picks the
// default named beside it. The daemon's flags map onto the fields one to
// one: --remote-connections, --remote-chunk-size, --remote-cache-size,
// --cache-dir, --cache-dir-size, --remote-timeout, --ca-file,
// --s3-endpoint, --s3-virtual-host, --s3-region.
type Options struct {
	// Connections is the most range requests a Client has in flight at
	// once, over all its objects (default 8).
	Connections int
	// ChunkSize is the unit of caching and the smallest range fetched
	// (default 256 KiB; 4 KiB to 16 MiB, a power of two). Small chunks
	// fetch little beyond what random readers touch; sequential readers get
	// large requests anyway, since adjacent missing chunks are fetched in
	// one request of up to MaxRequest bytes.
	ChunkSize int64
	// MaxRequest is the most bytes one range request asks for (default
	// 4 MiB, at least ChunkSize).
	MaxRequest int64
	// MaxReadahead bounds how far ahead of a sequential reader chunks are
	// prefetched (default 32 MiB, at most a quarter of CacheSize).
	MaxReadahead int64
	// CacheSize is the memory chunk cache, shared by all objects of the
	// Client (default 128 MiB, at least 2 chunks). It is all the memory the
	// Client holds for data: buffers are allocated on first use and reused.
	CacheSize int64
	// CacheDir, if set, keeps fetched chunks on disk too, in files under
	// CacheDir/qcowfs-remote-v1, bounded by CacheDirSize (default 1 GiB).
	// Chunks are keyed by URL and version, so a replaced object never reads
	// stale chunks, and a later Client finds the chunks of earlier ones.
	CacheDir     string
	CacheDirSize int64
	// Timeout bounds every Open, List and ReadAt (default 30 s): what cannot
	// be served in that time, retries included, fails with ErrTimeout.
	Timeout time.Duration
	// StallTimeout aborts and retries one request that receives no byte for
	// that long (default Timeout/3).
	StallTimeout time.Duration
	// RetryBase and RetryMax shape the exponential backoff between retries
	// (defaults 50 ms and 2 s); each wait is drawn at random between half
	// and all of min(RetryMax, RetryBase*2^attempt).
	RetryBase, RetryMax time.Duration
	// CAFile is a PEM file of CA certificates trusted for https:// (and an
	// https S3Endpoint) besides the system pool.
	CAFile string
	// S3Endpoint is the URL of an S3-compatible store (MinIO, Ceph RGW,
	// versitygw); empty means AWS. With an endpoint, buckets are addressed
	// by path (http://endpoint/bucket/key) unless S3VirtualHost.
	S3Endpoint    string
	S3VirtualHost bool
	// S3Region is the region to sign for; default: the SDK's configuration
	// (AWS_REGION, the profile), else us-east-1.
	S3Region string
	// S3Credentials replaces the SDK's standard credential chain
	// (environment, shared config and credentials files and profiles, SSO,
	// web identity, container and instance metadata) when set.
	S3Credentials aws.CredentialsProvider
	// ListPageSize is the MaxKeys of each ListObjectsV2 page (default: the
	// server's, 1000 on AWS).
	ListPageSize int32
	// HydrateRate caps the bytes a second that hydrations (hydrate.go)
	// fetch, all objects together; 0: no cap.
	HydrateRate int64
	// Offline sends no request: objects are read from the disk cache
	// alone, at the version an online Open recorded there (offline.go).
	// It needs CacheDir.
	Offline bool
	// Log receives one line per event worth telling an operator (an object
	// changed, a retry, a refused server); default: discarded.
	Log *slog.Logger
}

const (
	defaultConnections  = 8
	defaultChunkSize    = 256 << 10
	defaultMaxRequest   = 4 << 20
	defaultMaxReadahead = 32 << 20
	defaultCacheSize    = 128 << 20
	defaultCacheDirSize = 1 << 30
	defaultTimeout      = 30 * time.Second
	defaultRetryBase    = 50 * time.Millisecond
	defaultRetryMax     = 2 * time.Second
)

// withDefaults fills in the defaults and checks the values.
func (o Options) withDefaults() (Options, error) {
	if o.Connections == 0 {
		o.Connections = defaultConnections
	}
	if o.ChunkSize == 0 {
		o.ChunkSize = defaultChunkSize
	}
	if o.MaxRequest == 0 {
		o.MaxRequest = max(defaultMaxRequest, o.ChunkSize)
	}
	if o.CacheSize == 0 {
		o.CacheSize = max(defaultCacheSize, 2*o.ChunkSize)
	}
	if o.MaxReadahead == 0 {
		o.MaxReadahead = defaultMaxReadahead
	}
	if o.CacheDirSize == 0 {
		o.CacheDirSize = defaultCacheDirSize
	}
	if o.Timeout == 0 {
		o.Timeout = defaultTimeout
	}
	if o.StallTimeout == 0 {
		o.StallTimeout = o.Timeout / 3
	}
	if o.RetryBase == 0 {
		o.RetryBase = defaultRetryBase
	}
	if o.RetryMax == 0 {
		o.RetryMax = defaultRetryMax
	}
	if o.Log == nil {
		o.Log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	switch {
	case o.Connections < 1 || o.Connections > 1024:
		return o, fmt.Errorf("remote: Connections %d: want 1 to 1024", o.Connections)
	case o.ChunkSize < 4<<10 || o.ChunkSize > 16<<20 || o.ChunkSize&(o.ChunkSize-1) != 0:
		return o, fmt.Errorf("remote: ChunkSize %d: want a power of two from 4 KiB to 16 MiB", o.ChunkSize)
	case o.MaxRequest < o.ChunkSize:
		return o, fmt.Errorf("remote: MaxRequest %d is less than ChunkSize %d", o.MaxRequest, o.ChunkSize)
	case o.CacheSize < 2*o.ChunkSize:
		return o, fmt.Errorf("remote: CacheSize %d: want at least two chunks (%d)", o.CacheSize, 2*o.ChunkSize)
	case o.MaxReadahead < 0 || o.CacheDirSize < 0 || o.HydrateRate < 0 || o.Timeout < 0 || o.StallTimeout < 0 || o.RetryBase < 0 || o.RetryMax < 0:
		return o, fmt.Errorf("remote: negative size or duration in Options")
	case o.Offline && o.CacheDir == "":
		return o, fmt.Errorf("remote: Offline needs a disk cache (CacheDir)")
	case o.CacheDir != "" && o.CacheDirSize < o.ChunkSize:
		return o, fmt.Errorf("remote: CacheDirSize %d is less than one chunk (%d)", o.CacheDirSize, o.ChunkSize)
	}
	o.MaxReadahead = min(o.MaxReadahead, o.CacheSize/4)
	return o, nil
}
