package servers

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Nginx is an nginx serving a folder on 127.0.0.1, started by StartNginx.
type Nginx struct {
	URL       string // http://127.0.0.1:PORT or https://..., no trailing slash
	Root      string // the folder served
	CAFile    string // with TLS: the CA that signed the server's certificate
	AccessLog string // one line per request, parsed by Log
	proc      *process
}

// Access is one line of the access log.
type Access struct {
	Method    string
	URI       string
	Status    int
	Range     string // the request's Range header, "" if none
	IfMatch   string // the request's If-Match header, "" if none
	BodyBytes int64  // body bytes sent (of a response cut short: as far as it got)
	Bytes     int64  // all bytes sent, headers included
}

// StartNginx starts nginx serving root, over TLS with a certificate from a
// new CA (NewCA) if tls is set. It runs as a child process in the
// foreground (daemon off, master_process off) with everything, its pid,
// logs and temp folders, in a temporary prefix, and is stopped when the
// test ends.
func StartNginx(t testing.TB, root string, tls bool) *Nginx {
	t.Helper()
	bin := Require(t, "nginx")
	var err error
	if root, err = filepath.Abs(root); err != nil {
		t.Fatal(err)
	}
	prefix := t.TempDir()
	n := &Nginx{Root: root, AccessLog: filepath.Join(prefix, "access.log")}
	var ca CA
	if tls {
		ca = NewCA(t, prefix)
		n.CAFile = ca.CAFile
	}
	var lastErr error
	for range 5 { // a port found free may be taken before nginx binds it
		port := freePort(t)
		conf := filepath.Join(prefix, "nginx.conf")
		if err := os.WriteFile(conf, []byte(NginxConf(prefix, root, port, tls, ca)), 0o644); err != nil {
			t.Fatal(err)
		}
		errLog := filepath.Join(prefix, "error.log")
		cmd := exec.Command(bin, "-p", prefix, "-c", conf, "-e", errLog)
		p := start(t, "nginx", cmd, filepath.Join(prefix, "stderr.log"))
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		if lastErr = p.waitUp(dialReady(addr)); lastErr != nil {
			p.stop()
			b, _ := os.ReadFile(errLog)
			lastErr = fmt.Errorf("%w\nerror.log: %s", lastErr, b)
			if strings.Contains(string(b), "Address already in use") {
				continue
			}
			break
		}
		n.proc = p
		scheme := "http"
		if tls {
			scheme = "https"
		}
		n.URL = fmt.Sprintf("%s://%s", scheme, addr)
		t.Cleanup(p.stop)
		return n
	}
	t.Fatalf("nginx: %v", lastErr)
	return nil
}

// NginxConf is the configuration of an nginx in the foreground (no daemon,
// no master process) with its files under prefix, serving root on
// 127.0.0.1:port, over TLS with ca's certificate if tls. Its access log,
// prefix/access.log, is what Log parses. The benchmark's nginx uses it too.
func NginxConf(prefix, root string, port int, tls bool, ca CA) string {
	var b strings.Builder
	fmt.Fprintf(&b, `daemon off;
master_process off;
worker_processes 1;
pid %[1]s/nginx.pid;
error_log %[1]s/error.log warn;
events { worker_connections 1024; }
http {
    default_type application/octet-stream;
    log_format qcowfs '$request_method\t$uri\t$status\t$http_range\t$http_if_match\t$body_bytes_sent\t$bytes_sent';
    access_log %[1]s/access.log qcowfs;
    client_body_temp_path %[1]s/client_body;
    proxy_temp_path %[1]s/proxy;
    fastcgi_temp_path %[1]s/fastcgi;
    uwsgi_temp_path %[1]s/uwsgi;
    scgi_temp_path %[1]s/scgi;
    sendfile on;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    server {
`, prefix)
	if tls {
		fmt.Fprintf(&b, "        listen 127.0.0.1:%d ssl;\n        ssl_certificate %s;\n        ssl_certificate_key %s;\n", port, ca.CertFile, ca.KeyFile)
	} else {
		fmt.Fprintf(&b, "        listen 127.0.0.1:%d;\n", port)
	}
	fmt.Fprintf(&b, "        root %s;\n    }\n}\n", root)
	return b.String()
}

// Stop stops nginx now (it is stopped at the end of the test anyway):
// for tests of what still reads without the server.
func (n *Nginx) Stop() { n.proc.stop() }

// Log returns the requests logged so far. nginx logs a request when it is
// done with it, which may be a moment after the client has its bytes: use
// WaitLog to wait for a known number.
func (n *Nginx) Log(t testing.TB) []Access {
	t.Helper()
	f, err := os.Open(n.AccessLog)
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []Access
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fld := strings.Split(sc.Text(), "\t")
		if len(fld) != 7 {
			t.Fatalf("nginx access log: bad line %q", sc.Text())
		}
		a := Access{Method: fld[0], URI: fld[1], Range: dash(fld[3]), IfMatch: dash(fld[4])}
		a.Status, _ = strconv.Atoi(fld[2])
		a.BodyBytes, _ = strconv.ParseInt(fld[5], 10, 64)
		a.Bytes, _ = strconv.ParseInt(fld[6], 10, 64)
		out = append(out, a)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func dash(s string) string {
	if s == "-" {
		return ""
	}
	return s
}

// WaitLog returns the log once it has at least count requests, failing the
// test if that takes over 10 s.
func (n *Nginx) WaitLog(t testing.TB, count int) []Access {
	t.Helper()
	return n.waitLog(t, func(l []Access) bool { return len(l) >= count }, fmt.Sprintf("%d requests", count))
}

// WaitBodyBytes returns the log once its requests' bodies add up to at
// least n bytes, failing the test if that takes over 10 s: a client may
// have all its bytes before nginx has logged the last request.
func (n *Nginx) WaitBodyBytes(t testing.TB, bytes int64) []Access {
	t.Helper()
	return n.waitLog(t, func(l []Access) bool { return BodyBytes(l) >= bytes }, fmt.Sprintf("%d body bytes", bytes))
}

// waitLog returns the log once done says it is, failing the test with
// what was wanted if that takes over 10 s.
func (n *Nginx) waitLog(t testing.TB, done func([]Access) bool, want string) []Access {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		l := n.Log(t)
		if done(l) {
			return l
		}
		if time.Now().After(deadline) {
			t.Fatalf("nginx's log after 10 s: %d requests of %d body bytes; want %s", len(l), BodyBytes(l), want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// BodyBytes sums the body bytes of the requests logged.
func BodyBytes(log []Access) int64 {
	var s int64
	for _, a := range log {
		s += a.BodyBytes
	}
	return s
}
