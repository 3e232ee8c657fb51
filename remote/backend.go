package remote

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// meta is what pins one version of an object: learnt from the response to
// the first request, checked on every response after it.
type meta struct {
	size         int64
	etag         string // as the server sent it, quotes included; "" if none
	lastModified string // HTTP only, used when there is no strong ETag
	versionID    string // S3 only, set when the bucket is versioned
}

// version is what Object.Version shows: the S3 version id, else the ETag,
// else the modification time.
func (m meta) version() string {
	switch {
	case m.versionID != "":
		return m.versionID
	case m.etag != "":
		return m.etag
	}
	return m.lastModified
}

// A backend speaks one protocol. get starts a GET of the bytes [off, off+n)
// and checks the response's status and headers; the caller reads the body
// and checks it holds n bytes. With pin nil, get is the open request: no
// precondition, the range may run past the end (the body then holds the
// object's first bytes), and the meta it returns describes the object.
// With pin set, the request is conditional on that version, and any sign
// of another version is an error wrapping ErrChanged. A nil body with a
// nil error means an empty object (open only).
type backend interface {
	get(ctx context.Context, off, n int64, pin *meta) (body io.ReadCloser, m meta, err error)
}

// httpBackend reads http:// and https:// URLs with ranged GETs.
type httpBackend struct {
	client *http.Client
	url    *url.URL // as given, userinfo included (Go sends it as basic auth)
}

func (h *httpBackend) get(ctx context.Context, off, n int64, pin *meta) (io.ReadCloser, meta, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, h.url.String(), nil)
	if err != nil {
		return nil, meta{}, fmt.Errorf("%w: %v", ErrBadURL, err)
	}
	req.Header.Set("Range", fmt.Sprintf("bytes=%d-%d", off, off+n-1))
	// Ask for the stored bytes: a compressed response has other offsets.
	req.Header.Set("Accept-Encoding", "identity")
	if pin != nil {
		switch {
		case pin.etag != "" && !strings.HasPrefix(pin.etag, "W/"):
			req.Header.Set("If-Match", pin.etag)
		case pin.lastModified != "":
			// If-Match never matches a weak ETag (RFC 9110, 13.1.1); the
			// modification time is the next best pin, and the ETag is
			// still compared below.
			req.Header.Set("If-Unmodified-Since", pin.lastModified)
		}
	}
	resp, err := h.client.Do(req)
	if err != nil {
		return nil, meta{}, netError(ctx, err)
	}
	m := meta{etag: resp.Header.Get("ETag"), lastModified: resp.Header.Get("Last-Modified")}
	fail := func(err error) (io.ReadCloser, meta, error) {
		// Closing an unread body closes the connection instead of draining
		// it: a server that sends a whole image for a range costs no more
		// than what is in flight.
		resp.Body.Close()
		return nil, m, err
	}
	switch code := resp.StatusCode; {
	case code == http.StatusPartialContent:
	case code == http.StatusOK:
		if pin == nil && resp.ContentLength == 0 {
			resp.Body.Close()
			return nil, m, nil // an empty object: nothing to range over
		}
		return fail(fmt.Errorf("%w: asked for bytes %d-%d, got status 200 with the whole body (Content-Length %d)",
			ErrNoRange, off, off+n-1, resp.ContentLength))
	case code == http.StatusRequestedRangeNotSatisfiable:
		total, ok := totalOf(resp.Header.Get("Content-Range"))
		if pin == nil && ok && total == 0 {
			resp.Body.Close()
			return nil, m, nil
		}
		if pin != nil && ok && total != pin.size {
			return fail(fmt.Errorf("%w: size is now %d, was %d (status 416)", ErrChanged, total, pin.size))
		}
		return fail(fmt.Errorf("range %d-%d refused: %w", off, off+n-1, statusOf(resp)))
	case code == http.StatusPreconditionFailed && pin != nil:
		return fail(fmt.Errorf("%w: version %s is gone (status 412)", ErrChanged, pin.version()))
	case (code == http.StatusNotFound || code == http.StatusGone) && pin != nil:
		return fail(fmt.Errorf("%w: the object is gone (%w)", ErrChanged, statusOf(resp)))
	case code == http.StatusNotFound || code == http.StatusGone:
		return fail(fmt.Errorf("%w: %w", ErrNotFound, statusOf(resp)))
	case code == http.StatusUnauthorized || code == http.StatusForbidden:
		return fail(fmt.Errorf("%w: %w", ErrAuth, statusOf(resp)))
	case code == http.StatusTooManyRequests || code >= 500:
		return fail(retryAfter(resp, transient(statusOf(resp))))
	default:
		return fail(statusOf(resp))
	}
	start, end, total, err := parseContentRange(resp.Header.Get("Content-Range"))
	if err != nil {
		return fail(fmt.Errorf("%w: status 206 with %v", ErrNoRange, err))
	}
	m.size = total
	want := off + n - 1
	if pin == nil {
		want = min(want, total-1)
	}
	if pin != nil {
		if total != pin.size {
			return fail(fmt.Errorf("%w: size is now %d, was %d", ErrChanged, total, pin.size))
		}
		if pin.etag != "" && m.etag != "" && m.etag != pin.etag {
			// The server ignored If-Match.
			return fail(fmt.Errorf("%w: ETag is now %s, was %s", ErrChanged, m.etag, pin.etag))
		}
		if pin.lastModified != "" && m.lastModified != "" && m.lastModified != pin.lastModified {
			return fail(fmt.Errorf("%w: Last-Modified is now %s, was %s", ErrChanged, m.lastModified, pin.lastModified))
		}
	}
	if start != off || end != want {
		return fail(fmt.Errorf("%w: asked for bytes %d-%d, got %d-%d", ErrNoRange, off, want, start, end))
	}
	// A Content-Length short of the range is not refused here: the caller
	// reads what there is, counts it short, and asks again for the rest.
	return resp.Body, m, nil
}

func statusOf(resp *http.Response) *StatusError {
	return &StatusError{Code: resp.StatusCode}
}

// retryAfter attaches a server's Retry-After (in seconds) to err.
func retryAfter(resp *http.Response, err error) error {
	s, perr := strconv.Atoi(resp.Header.Get("Retry-After"))
	if perr != nil || s <= 0 {
		return err
	}
	return &waitError{err, time.Duration(s) * time.Second}
}

// waitError is a transient failure whose server asked for a pause.
type waitError struct {
	error
	after time.Duration
}

func (e *waitError) Unwrap() error { return e.error }

// parseContentRange parses "bytes START-END/TOTAL".
func parseContentRange(s string) (start, end, total int64, err error) {
	bad := fmt.Errorf("Content-Range %q", s)
	rest, ok := strings.CutPrefix(s, "bytes ")
	if !ok {
		return 0, 0, 0, bad
	}
	rng, tot, ok := strings.Cut(rest, "/")
	if !ok {
		return 0, 0, 0, bad
	}
	a, b, ok := strings.Cut(rng, "-")
	if !ok {
		return 0, 0, 0, bad
	}
	start, err1 := strconv.ParseInt(a, 10, 64)
	end, err2 := strconv.ParseInt(b, 10, 64)
	total, err3 := strconv.ParseInt(tot, 10, 64)
	if err1 != nil || err2 != nil || err3 != nil || start < 0 || end < start || total <= end {
		return 0, 0, 0, bad
	}
	return start, end, total, nil
}

// totalOf parses the total of "bytes */TOTAL" (a 416's Content-Range).
func totalOf(s string) (int64, bool) {
	tot, ok := strings.CutPrefix(s, "bytes */")
	if !ok {
		return 0, false
	}
	t, err := strconv.ParseInt(tot, 10, 64)
	return t, err == nil && t >= 0
}

// netError classifies an error of a request (made under ctx) that got no
// response, or whose body broke off. A *url.Error names the request's URL,
// query and all; its cause alone is kept. Certificate errors, and a TLS
// handshake that fails, are permanent, and say so; if ctx ended, its error
// is returned for the caller to report; everything else (refused, reset,
// cut short, a transport timeout) is transient, with the failures that
// found no server at all (refused, no route, a name that does not
// resolve) marked unreachable, which Open and List do not retry
// (failFast). The test is ctx, not the error: some of net/http's own
// timeouts match context.DeadlineExceeded.
func netError(ctx context.Context, err error) error {
	if ue, ok := errors.AsType[*url.Error](err); ok {
		err = ue.Err
	}
	var (
		unknown  x509.UnknownAuthorityError
		hostname x509.HostnameError
		invalid  x509.CertificateInvalidError
		verify   *tls.CertificateVerificationError
		record   tls.RecordHeaderError
		alert    tls.AlertError
	)
	switch {
	case errors.As(err, &unknown), errors.As(err, &hostname), errors.As(err, &invalid), errors.As(err, &verify):
		return fmt.Errorf("TLS: %w (give the server's CA with --ca-file)", err)
	case errors.As(err, &record), errors.As(err, &alert),
		strings.Contains(err.Error(), "server gave HTTP response to HTTPS client"): // net/http drops the RecordHeaderError
		return fmt.Errorf("TLS: %w", err)
	case ctx.Err() != nil:
		return ctx.Err() // the caller knows why its context ended
	case isUnreachable(err):
		return transient(&unreachableError{err})
	}
	return transient(err)
}

// unreachableError is a request that found no server: the connection
// refused, no route to the host, a name that does not resolve. For an
// object that was read before it is transient (a server restarting
// refuses connections for a moment); at Open and List, where nothing was
// reached yet, permanent (failFast): the cause is reported at once
// instead of after Options.Timeout of retries.
type unreachableError struct{ err error }

func (e *unreachableError) Error() string { return e.err.Error() }
func (e *unreachableError) Unwrap() error { return e.err }

func isUnreachable(err error) bool {
	if dns, ok := errors.AsType[*net.DNSError](err); ok {
		return dns.IsNotFound
	}
	return errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EHOSTUNREACH) || errors.Is(err, syscall.ENETUNREACH)
}

// failFast turns an unreachable server into a permanent failure, for the
// first request to it (Open, List).
func failFast(err error) error {
	if ue, ok := errors.AsType[*unreachableError](err); ok {
		return ue
	}
	return err
}

// tlsConfig trusts the system pool plus the certificates of caFile.
func tlsConfig(caFile string) (*tls.Config, error) {
	pool, err := x509.SystemCertPool()
	if err != nil || pool == nil {
		pool = x509.NewCertPool()
	}
	if caFile != "" {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return nil, fmt.Errorf("remote: CA file: %w", err)
		}
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("remote: CA file %s holds no PEM certificate", caFile)
		}
	}
	return &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: pool}, nil
}

// tuneTransport sets up a transport for range requests: up to conns
// connections per host, TLS with tlsConf, dial and handshake timeouts of
// stall (the wait for headers and body is transfer's stall watchdog), no
// transparent decompression. The S3 client's
// transport gets the same (the SDK builds its own, so that it can add
// AWS_CA_BUNDLE to the pool).
func tuneTransport(tr *http.Transport, conns int, tlsConf *tls.Config, stall time.Duration) {
	dialer := &net.Dialer{Timeout: stall, KeepAlive: 30 * time.Second}
	tr.Proxy = http.ProxyFromEnvironment
	tr.DialContext = dialer.DialContext
	tr.TLSClientConfig = tlsConf.Clone()
	tr.TLSHandshakeTimeout = stall
	tr.MaxConnsPerHost = conns
	tr.MaxIdleConns = 4 * conns
	tr.MaxIdleConnsPerHost = conns
	tr.IdleConnTimeout = 90 * time.Second
	tr.DisableCompression = true
	tr.ForceAttemptHTTP2 = true
}
