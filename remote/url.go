package remote

import (
	"fmt"
	"net/url"
	"strings"
)

// IsURL reports whether s names a remote object this package opens: an
// http://, https:// or s3:// URL with a host (for s3, the bucket). Anything
// else, including "file:" and qemu's other protocol prefixes, is a local
// name for the caller to deal with.
func IsURL(s string) bool {
	u, err := url.Parse(s)
	if err != nil || u.Host == "" || u.Opaque != "" {
		return false
	}
	switch strings.ToLower(u.Scheme) {
	case "http", "https", "s3":
		return true
	}
	return false
}

// parseURL parses an object URL and checks its scheme and host.
func parseURL(raw string) (*url.URL, error) {
	u, err := url.Parse(raw)
	if err != nil {
		// url.Error repeats the input, which may hold a password.
		return nil, fmt.Errorf("%w: cannot parse %q", ErrBadURL, Redact(raw))
	}
	u.Scheme = strings.ToLower(u.Scheme)
	if !IsURL(u.String()) {
		return nil, fmt.Errorf("%w: %q: want http://, https:// or s3://BUCKET/KEY", ErrBadURL, redactURL(u))
	}
	u.Fragment, u.RawFragment = "", ""
	return u, nil
}

// Resolve resolves name, a backing or external data file name found in the
// image at baseURL, the way qemu's path_combine resolves it against a local
// image's path: a relative name is relative to the folder of the image, an
// absolute path ("/x/y") is on the same server (or bucket). A name that is
// itself an http://, https:// or s3:// URL is returned as it is. Any other
// scheme (file:, nbd:, json:, ...) is refused: a remote image never gets to
// name a local file. Dot segments are resolved (RFC 3986, section 5.2).
//
// Resolve does not decide whether the result may be opened: check it with
// Within against the prefixes the user allowed.
func Resolve(baseURL, name string) (string, error) {
	base, err := parseURL(baseURL)
	if err != nil {
		return "", err
	}
	if name == "" {
		return "", fmt.Errorf("%w: empty file name in %s", ErrBadURL, redactURL(base))
	}
	ref, err := url.Parse(name)
	if err != nil {
		return "", fmt.Errorf("%w: file name %q in %s does not parse as a URL reference", ErrBadURL, Redact(name), redactURL(base))
	}
	if ref.Scheme != "" {
		if !IsURL(name) {
			return "", fmt.Errorf("%w: file name %q in %s is not an http, https or s3 URL", ErrBadURL, Redact(name), redactURL(base))
		}
		return name, nil
	}
	if ref.Host != "" {
		// "//host/path" would jump to another server with base's scheme.
		return "", fmt.Errorf("%w: file name %q in %s names another host", ErrBadURL, Redact(name), redactURL(base))
	}
	// The base's query (a presigned URL's signature, say) is for the base
	// alone; ResolveReference drops it since ref has a path.
	return base.ResolveReference(ref).String(), nil
}

// Within reports whether the URL u lies under one of prefixes: same scheme
// and host (the bucket, for s3), and a path in the prefix's folder. A prefix
// "s3://b/images/" or "s3://b/images" allows s3://b/images/x/y but not
// s3://b/images2/x. A URL whose path has a "." or ".." segment, even
// percent-encoded, is never within anything: a server may resolve it after
// the check. Credentials and queries are ignored on both sides.
func Within(u string, prefixes []string) bool {
	pu, err := url.Parse(u)
	if err != nil || !IsURL(u) {
		return false
	}
	if hasDotSegment(pu.Path) || hasDotSegment(pu.EscapedPath()) {
		return false
	}
	for _, p := range prefixes {
		pp, err := url.Parse(p)
		if err != nil || !IsURL(p) || hasDotSegment(pp.Path) {
			continue
		}
		if !strings.EqualFold(pu.Scheme, pp.Scheme) || !sameHost(pu, pp) {
			continue
		}
		dir := pp.Path
		if pu.Path == dir || dir == "" || dir == "/" {
			return true
		}
		if !strings.HasSuffix(dir, "/") {
			dir += "/"
		}
		if strings.HasPrefix(pu.Path, dir) {
			return true
		}
	}
	return false
}

func hasDotSegment(p string) bool {
	for seg := range strings.SplitSeq(p, "/") {
		if seg == "." || seg == ".." {
			return true
		}
	}
	return false
}

// sameHost compares hosts case-insensitively, with the scheme's default
// port made explicit.
func sameHost(a, b *url.URL) bool {
	port := func(u *url.URL) string {
		if p := u.Port(); p != "" {
			return p
		}
		switch strings.ToLower(u.Scheme) {
		case "http":
			return "80"
		case "https":
			return "443"
		}
		return ""
	}
	return strings.EqualFold(a.Hostname(), b.Hostname()) && port(a) == port(b)
}

// Redact returns raw with what might be a secret removed: the userinfo
// (user and password) and the values of query parameters that carry
// signatures, credentials or tokens (X-Amz-Signature, X-Amz-Credential,
// X-Amz-Security-Token, Signature, sig, token, ...). It is what every log
// line and error message of this package shows.
func Redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		// The parts cannot be told apart for sure: drop the query and
		// fragment, and anything before an '@' in the authority.
		s, q := raw, ""
		if i := strings.IndexAny(s, "?#"); i >= 0 {
			s, q = s[:i], "?<redacted>"
		}
		rest, scheme := s, ""
		if i := strings.Index(s, "://"); i >= 0 {
			scheme, rest = s[:i+3], s[i+3:]
		}
		auth, path := rest, ""
		if i := strings.IndexByte(rest, '/'); i >= 0 {
			auth, path = rest[:i], rest[i:]
		}
		if i := strings.LastIndexByte(auth, '@'); i >= 0 {
			auth = "REDACTED@" + auth[i+1:]
		}
		return scheme + auth + path + q
	}
	return redactURL(u)
}

func redactURL(u *url.URL) string {
	c := *u
	if c.User != nil {
		c.User = url.User("REDACTED")
	}
	if c.RawQuery != "" {
		q := c.Query()
		for k := range q {
			if secretParam(k) {
				q[k] = []string{"REDACTED"}
			}
		}
		c.RawQuery = q.Encode()
	}
	return c.String()
}

func secretParam(name string) bool {
	n := strings.ToLower(name)
	for _, s := range []string{"signature", "credential", "token", "secret", "password", "passwd", "key", "sig", "auth", "session"} {
		if strings.Contains(n, s) {
			return true
		}
	}
	return false
}

// SameObject reports whether the URLs a and b name the same object: the
// same scheme, host (with the default port made explicit) and path, and
// the same query but for its signature parameters (those Redact hides,
// and X-Amz-*: a presigned URL made again names the same object).
// Userinfo is ignored. An overlay names its remote base by URL, and a
// later mount of the same object by another presigned URL, or with
// another password, finds it again.
func SameObject(a, b string) bool {
	ua, erra := parseURL(a)
	ub, errb := parseURL(b)
	if erra != nil || errb != nil {
		return false
	}
	return ua.Scheme == ub.Scheme && sameHost(ua, ub) && ua.EscapedPath() == ub.EscapedPath() &&
		objectQuery(ua) == objectQuery(ub)
}

// objectQuery is u's query without its signature parameters, encoded
// (sorted by key).
func objectQuery(u *url.URL) string {
	q := u.Query()
	for k := range q {
		if secretParam(k) || strings.HasPrefix(strings.ToLower(k), "x-amz-") {
			delete(q, k)
		}
	}
	return q.Encode()
}

// WithoutUserinfo returns raw without its userinfo (user and password),
// as it may be written into a file: the rest, query included, is kept.
func WithoutUserinfo(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.User == nil {
		return raw
	}
	u.User = nil
	return u.String()
}
