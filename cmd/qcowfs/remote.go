package main

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"time"

	"github.com/qcowfs/qcowfs/internal/remotefile"
	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/remote"
)

// Remote images: the flags of package remote's Options, shared by mount,
// info, map and check, which all take http://, https:// and s3:// URLs
// where they take an image file.

// remoteFlags map one to one onto remote.Options.
type remoteFlags struct {
	S3Endpoint        string        `name:"s3-endpoint" placeholder:"URL" help:"For s3:// URLs: the endpoint of an S3-compatible store (MinIO, Ceph RGW, versitygw) instead of AWS; buckets there are addressed by path unless --s3-virtual-host."`
	S3Region          string        `name:"s3-region" placeholder:"REGION" help:"For s3:// URLs: the region to sign for. Default: the AWS configuration (AWS_REGION, the profile), else us-east-1."`
	S3VirtualHost     bool          `name:"s3-virtual-host" help:"With --s3-endpoint: address buckets as BUCKET.endpoint rather than endpoint/BUCKET."`
	RemoteConnections int           `default:"8" placeholder:"N" help:"Remote images: the most range requests in flight at once (default: ${default})."`
	RemoteChunkSize   byteSize      `default:"256K" placeholder:"SIZE" help:"Remote images: the unit of caching and the smallest range fetched, a power of two from 4K to 16M (default: ${default})."`
	RemoteReadahead   byteSize      `default:"32M" placeholder:"SIZE" help:"Remote images: how far ahead of a sequential reader chunks are fetched, at most a quarter of the cache size (default: ${default})."`
	RemoteCacheSize   byteSize      `default:"128M" placeholder:"SIZE" help:"Remote images: memory for fetched chunks, shared by all remote images (default: ${default})."`
	RemoteTimeout     time.Duration `default:"30s" placeholder:"DURATION" help:"Remote images: a read (or open, or listing) that cannot be served in this time, retries included, fails with EIO (default: ${default})."`
	CacheDir          string        `placeholder:"DIR" help:"Remote images: also keep fetched chunks on disk under DIR, bounded by the cache dir size below; later mounts find them there."`
	CacheDirSize      byteSize      `default:"1G" placeholder:"SIZE" help:"Remote images: the most bytes the disk cache keeps (default: ${default})."`
	CAFile            string        `name:"ca-file" placeholder:"PATH" help:"Remote images: trust the CA certificates in this PEM file for https (an https S3 endpoint too), besides the system CAs."`

	hydrateRate int64 // mount's --hydrate=RATE (remote.Options.HydrateRate)
	offline     bool  // mount's --offline (remote.Options.Offline)
}

// absPaths makes the path flags absolute.
func (r *remoteFlags) absPaths() error { return makeAbs(&r.CacheDir, &r.CAFile) }

// makeAbs makes each path given absolute against the working folder; an
// empty one stays empty.
func makeAbs(paths ...*string) error {
	for _, p := range paths {
		if *p == "" {
			continue
		}
		abs, err := filepath.Abs(*p)
		if err != nil {
			return err
		}
		*p = abs
	}
	return nil
}

// options are the remote.Options the flags say.
func (r *remoteFlags) options(log *slog.Logger) remote.Options {
	return remote.Options{
		Connections:   r.RemoteConnections,
		ChunkSize:     int64(r.RemoteChunkSize),
		CacheSize:     int64(r.RemoteCacheSize),
		MaxReadahead:  int64(r.RemoteReadahead),
		CacheDir:      r.CacheDir,
		CacheDirSize:  int64(r.CacheDirSize),
		Timeout:       r.RemoteTimeout,
		CAFile:        r.CAFile,
		S3Endpoint:    r.S3Endpoint,
		S3VirtualHost: r.S3VirtualHost,
		S3Region:      r.S3Region,
		HydrateRate:   r.hydrateRate,
		Offline:       r.offline,
		Log:           log,
	}
}

// client makes the remote client the flags say. Its messages go to log
// (nil: nowhere).
func (r *remoteFlags) client(log *slog.Logger) (*remote.Client, error) {
	if err := r.absPaths(); err != nil {
		return nil, err
	}
	c, err := remote.NewClient(context.Background(), r.options(log))
	if err != nil {
		return nil, fmt.Errorf("remote options: %w", err)
	}
	return c, nil
}

// splitAllowed separates the --allow-backing-outside values into local
// folders and URL prefixes.
func splitAllowed(all []string) (dirs, urls []string) {
	for _, a := range all {
		if remote.IsURL(a) {
			urls = append(urls, a)
		} else {
			dirs = append(dirs, a)
		}
	}
	return dirs, urls
}

// openRemoteImage opens the qcow2 image at url with its backing chain,
// whose files must lie in the image's folder or under one of allowed.
func openRemoteImage(c *remote.Client, url string, opts qcow2.Options, allowed []string) (*qcow2.Image, error) {
	ctx := context.Background()
	f, err := remotefile.Open(ctx, c, url)
	if err != nil {
		return nil, err
	}
	if ok, _ := qcow2.ProbeFile(f); !ok {
		f.Close()
		return nil, fmt.Errorf("%s: not a qcow2 image (remote images must be qcow2)", f.Name())
	}
	opts.AllowedDirs = nil
	opts.Opener = &remotefile.Opener{
		OpenURL: func(ctx context.Context, u string) (*remotefile.File, error) { return remotefile.Open(ctx, c, u) },
		Allowed: append([]string{remotefile.Folder(url)}, allowed...),
	}
	return qcow2.NewImage(f, opts)
}

// urlBackingOpener opens the backing files of a local image for info, map
// and check as qemu-img does: local names as qcow2.LocalOpener does, and
// a URL (the backing file of an overlay qcowfs made over a remote image;
// qemu-img opens an http(s) one with its curl driver) through the remote
// client, made at the first such name. The remote file's own chain is
// then confined as that of a remote image given to info is: its folder,
// and --allow-backing-outside URL prefixes.
type urlBackingOpener struct {
	local   qcow2.Opener
	flags   *remoteFlags
	allowed []string
	client  *remote.Client     // made at the first URL; closed by the caller
	remote  *remotefile.Opener // for the remote files' own names
}

func (o *urlBackingOpener) Open(image qcow2.HostFile, field, name string) (qcow2.HostFile, error) {
	if _, ok := image.(*remotefile.File); ok {
		return o.remote.Open(image, field, name)
	}
	if field != "backing file" || !remote.IsURL(name) {
		return o.local.Open(image, field, name)
	}
	if o.client == nil {
		c, err := o.flags.client(nil)
		if err != nil {
			return nil, err
		}
		o.client = c
	}
	f, err := remotefile.Open(context.Background(), o.client, name)
	if err != nil {
		return nil, err
	}
	o.remote = &remotefile.Opener{
		OpenURL: func(ctx context.Context, u string) (*remotefile.File, error) {
			return remotefile.Open(ctx, o.client, u)
		},
		Allowed: append([]string{remotefile.Folder(name)}, o.allowed...),
	}
	return f, nil
}

// shownSource is the source as messages and mount tables show it: a URL
// without credentials.
func shownSource(src string) string {
	if remote.IsURL(src) {
		return remote.Redact(src)
	}
	return src
}
