package remote

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/feature/ec2/imds"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/smithy-go"
	"github.com/aws/smithy-go/logging"
	smithyhttp "github.com/aws/smithy-go/transport/http"
)

// s3Backend reads one S3 object with ranged GetObject calls.
type s3Backend struct {
	api         *s3.Client
	bucket, key string
}

func (b *s3Backend) get(ctx context.Context, off, n int64, pin *meta) (io.ReadCloser, meta, error) {
	in := &s3.GetObjectInput{
		Bucket: &b.bucket,
		Key:    &b.key,
		Range:  aws.String(fmt.Sprintf("bytes=%d-%d", off, off+n-1)),
	}
	if pin != nil {
		if pin.etag != "" {
			in.IfMatch = aws.String(pin.etag)
		}
		if pin.versionID != "" {
			in.VersionId = aws.String(pin.versionID)
		}
	}
	out, err := b.api.GetObject(ctx, in)
	if err != nil {
		if pin == nil && s3Status(err) == http.StatusRequestedRangeNotSatisfiable {
			return b.head(ctx) // an empty object has no byte 0
		}
		return nil, meta{}, s3Error(ctx, err, pin)
	}
	m := meta{etag: aws.ToString(out.ETag), versionID: aws.ToString(out.VersionId)}
	fail := func(err error) (io.ReadCloser, meta, error) {
		out.Body.Close()
		return nil, m, err
	}
	start, end, total, err := parseContentRange(aws.ToString(out.ContentRange))
	if err != nil {
		return fail(fmt.Errorf("%w: GetObject answered a range request with %v", ErrNoRange, err))
	}
	m.size = total
	want := off + n - 1
	if pin == nil {
		want = min(want, total-1)
	} else {
		switch {
		case total != pin.size:
			return fail(fmt.Errorf("%w: size is now %d, was %d", ErrChanged, total, pin.size))
		case pin.etag != "" && m.etag != pin.etag:
			return fail(fmt.Errorf("%w: ETag is now %s, was %s", ErrChanged, m.etag, pin.etag))
		case pin.versionID != "" && m.versionID != pin.versionID:
			return fail(fmt.Errorf("%w: version id is now %s, was %s", ErrChanged, m.versionID, pin.versionID))
		}
	}
	if start != off || end != want {
		return fail(fmt.Errorf("%w: asked for bytes %d-%d, got %d-%d", ErrNoRange, off, want, start, end))
	}
	return out.Body, m, nil
}

// head describes an object without reading it (open of an empty object).
func (b *s3Backend) head(ctx context.Context) (io.ReadCloser, meta, error) {
	out, err := b.api.HeadObject(ctx, &s3.HeadObjectInput{Bucket: &b.bucket, Key: &b.key})
	if err != nil {
		return nil, meta{}, s3Error(ctx, err, nil)
	}
	m := meta{size: aws.ToInt64(out.ContentLength), etag: aws.ToString(out.ETag), versionID: aws.ToString(out.VersionId)}
	if m.size != 0 {
		return nil, m, fmt.Errorf("%w: a range at 0 was refused, yet the object holds %d bytes", ErrNoRange, m.size)
	}
	return nil, m, nil
}

func s3Status(err error) int {
	if re, ok := errors.AsType[*smithyhttp.ResponseError](err); ok {
		return re.HTTPStatusCode()
	}
	return 0
}

// s3Error classifies an S3 call's error. Its message is rebuilt from the
// status, the S3 error code and message, or the network error, so that
// nothing of the signed request shows.
func s3Error(ctx context.Context, err error, pin *meta) error {
	status := s3Status(err)
	var code, msg string
	if ae, ok := errors.AsType[smithy.APIError](err); ok {
		code, msg = ae.ErrorCode(), ae.ErrorMessage()
		if len(msg) > 200 {
			msg = msg[:200] + "..."
		}
	}
	if status == 0 && code == "" {
		return netError(ctx, unwrapAll(err))
	}
	se := &StatusError{Code: status, S3Code: code, Message: msg}
	switch {
	case authCodes[code]: // before 404: versitygw answers an unknown key with one
		return fmt.Errorf("%w: %w (check the access key and secret)", ErrAuth, se)
	case pin != nil && (status == http.StatusPreconditionFailed || code == "PreconditionFailed"):
		return fmt.Errorf("%w: version %s is gone (%w)", ErrChanged, pin.version(), se)
	case pin != nil && (status == http.StatusNotFound || code == "NoSuchKey" || code == "NoSuchVersion"):
		return fmt.Errorf("%w: the object is gone (%w)", ErrChanged, se)
	case status == http.StatusNotFound, code == "NoSuchKey", code == "NoSuchBucket", code == "NotFound":
		return fmt.Errorf("%w: %w", ErrNotFound, se)
	case status == http.StatusUnauthorized, status == http.StatusForbidden:
		return fmt.Errorf("%w: %w (check the access key and secret)", ErrAuth, se)
	case status == http.StatusTooManyRequests, status >= 500, retryCodes[code]:
		return transient(se)
	}
	return se
}

var authCodes = map[string]bool{
	"InvalidAccessKeyId": true, "SignatureDoesNotMatch": true, "AccessDenied": true,
	"ExpiredToken": true, "InvalidToken": true, "TokenRefreshRequired": true,
	"AuthorizationHeaderMalformed": true,
	"XAdminUserNotFound":           true, // versitygw's 404 for an unknown access key
}

var retryCodes = map[string]bool{
	"SlowDown": true, "Throttling": true, "ThrottlingException": true,
	"RequestThrottled": true, "RequestTimeout": true, "InternalError": true,
	"ServiceUnavailable": true, "RequestLimitExceeded": true,
}

// unwrapAll returns the innermost error of a chain: the network error
// under the SDK's operation and send errors.
func unwrapAll(err error) error {
	for {
		u := errors.Unwrap(err)
		if u == nil {
			return err
		}
		if _, ok := u.(*url.Error); ok {
			return u
		}
		err = u
	}
}

// s3Key returns the object key of s3://bucket/key.
func s3Key(u *url.URL) (string, error) {
	if u.Host == "" {
		return "", fmt.Errorf("%w: %s has no bucket", ErrBadURL, redactURL(u))
	}
	return strings.TrimPrefix(u.Path, "/"), nil
}

// s3URL is the URL of key in bucket.
func s3URL(bucket, key string) string {
	return (&url.URL{Scheme: "s3", Host: bucket, Path: "/" + key}).String()
}

// sdkLogger passes the AWS SDK's log lines to a Client's log: warnings
// as warnings, anything else at debug level.
type sdkLogger struct{ log *slog.Logger }

func (l sdkLogger) Logf(c logging.Classification, format string, v ...any) {
	msg := "aws sdk: " + fmt.Sprintf(format, v...)
	if c == logging.Warn {
		l.log.Warn(msg)
	} else {
		l.log.Debug(msg)
	}
}

// s3Client returns the Client's S3 client, made on first use from the SDK's
// configuration chain and the Options, with the credentials checked.
func (c *Client) s3Client(ctx context.Context) (*s3.Client, error) {
	c.s3mu.Lock()
	defer c.s3mu.Unlock()
	if c.s3api != nil {
		return c.s3api, nil
	}
	lo := []func(*config.LoadOptions) error{
		config.WithHTTPClient(awshttp.NewBuildableClient().WithTransportOptions(func(tr *http.Transport) {
			tuneTransport(tr, c.opts.Connections, c.tlsConf, c.opts.StallTimeout)
		})),
		// Retries are this package's own, bounded by Timeout, counted.
		config.WithRetryer(func() aws.Retryer { return aws.NopRetryer{} }),
		config.WithResponseChecksumValidation(aws.ResponseChecksumValidationWhenRequired),
		config.WithRequestChecksumCalculation(aws.RequestChecksumCalculationWhenRequired),
		// The SDK's own lines (its default is stderr, which a
		// daemon's terminal would show) go to this Client's log.
		config.WithLogger(sdkLogger{c.opts.Log}),
	}
	if c.opts.S3Endpoint != "" {
		// An S3-compatible store is not on EC2's network: asking the
		// instance metadata service for credentials there would only
		// wait for its timeouts (seconds) before failing.
		lo = append(lo, config.WithEC2IMDSClientEnableState(imds.ClientDisabled))
	}
	if c.opts.S3Region != "" {
		lo = append(lo, config.WithRegion(c.opts.S3Region))
	}
	if c.opts.S3Credentials != nil {
		lo = append(lo, config.WithCredentialsProvider(c.opts.S3Credentials))
	}
	cfg, err := config.LoadDefaultConfig(ctx, lo...)
	if err != nil {
		return nil, fmt.Errorf("S3 configuration: %w", err)
	}
	if cfg.Region == "" {
		cfg.Region = "us-east-1"
	}
	if cfg.Credentials == nil {
		return nil, fmt.Errorf("%w: no S3 credentials configured", ErrAuth)
	}
	if _, err := cfg.Credentials.Retrieve(ctx); err != nil {
		return nil, fmt.Errorf("%w: no S3 credentials found (environment, shared config, instance metadata): %v", ErrAuth, err)
	}
	c.s3api = s3.NewFromConfig(cfg, func(o *s3.Options) {
		if c.opts.S3Endpoint != "" {
			o.BaseEndpoint = aws.String(c.opts.S3Endpoint)
			o.UsePathStyle = !c.opts.S3VirtualHost
		}
	})
	return c.s3api, nil
}

// An Entry is one object of a listing.
type Entry struct {
	URL     string // s3://bucket/key
	Key     string // the full key
	Name    string // the key with the listing's prefix cut off
	Size    int64
	ETag    string
	ModTime time.Time
}

// List returns every object under prefixURL, s3://BUCKET/PREFIX (all
// pages, nested "folders" included, in key order). A prefix is a string
// prefix of keys, as in S3: end it with "/" to list a folder. Only s3://
// URLs can be listed.
func (c *Client) List(ctx context.Context, prefixURL string) ([]Entry, error) {
	u, err := parseURL(prefixURL)
	if err != nil {
		return nil, err
	}
	shown := redactURL(u)
	fail := func(err error) ([]Entry, error) {
		return nil, &Error{Op: "list", URL: shown, Off: -1, Err: err}
	}
	if u.Scheme != "s3" {
		return fail(fmt.Errorf("%w: only s3:// URLs can be listed", ErrBadURL))
	}
	if c.opts.Offline {
		return fail(fmt.Errorf("%w: a listing needs the server (the disk cache keeps none)", ErrOffline))
	}
	ctx, cancel := context.WithTimeout(ctx, c.opts.Timeout)
	defer cancel()
	api, err := c.s3Client(ctx)
	if err != nil {
		return fail(err)
	}
	prefix, _ := s3Key(u)
	in := &s3.ListObjectsV2Input{Bucket: aws.String(u.Host), Prefix: aws.String(prefix)}
	if c.opts.ListPageSize > 0 {
		in.MaxKeys = aws.Int32(c.opts.ListPageSize)
	}
	var all []Entry
	for {
		var out *s3.ListObjectsV2Output
		err := c.retry(ctx, nil, false, func(ctx context.Context) error {
			if err := c.acquire(ctx, false); err != nil {
				return err
			}
			defer c.release(false)
			c.st.requests.Add(1)
			var err error
			out, err = api.ListObjectsV2(ctx, in)
			if err != nil {
				return failFast(s3Error(ctx, err, nil))
			}
			return nil
		})
		if err != nil {
			return fail(err)
		}
		for _, o := range out.Contents {
			key := aws.ToString(o.Key)
			all = append(all, Entry{
				URL:     s3URL(u.Host, key),
				Key:     key,
				Name:    strings.TrimPrefix(key, prefix),
				Size:    aws.ToInt64(o.Size),
				ETag:    aws.ToString(o.ETag),
				ModTime: aws.ToTime(o.LastModified),
			})
		}
		if !aws.ToBool(out.IsTruncated) || aws.ToString(out.NextContinuationToken) == "" {
			return all, nil
		}
		in.ContinuationToken = out.NextContinuationToken
	}
}
