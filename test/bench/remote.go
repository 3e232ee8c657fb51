package main

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/servers"
)

// The remote workloads: the cached images served over HTTP by nginx (the
// work folder) and over S3 by versitygw (WORK/img, a bucket per image),
// each read through test/servers' proxy, which counts the body bytes it
// sends and, for the 20 ms rows, holds every request 20 ms before passing
// it on. Every run is a fresh mount, so no daemon cache carries over.

// network is the servers and proxies, started by the first workload that
// reads through them.
type network struct {
	nginx   *servers.Nginx
	s3      *servers.S3Server
	proxies map[string]*servers.FaultProxy
}

const s3Access, s3Secret = "qcowfs-bench", "qcowfs-bench-secret-0123456789"

// remote points t at w's image through its proxy: t.url for a mount, IMG
// for qemu's curl driver (HTTP only), GET and CURLAUTH for curl.
func (e *env) remote(w *workload, t *target) (err error) {
	defer func() {
		if r := recover(); r != nil {
			f, ok := r.(tbFatal)
			if !ok {
				panic(r)
			}
			err = fmt.Errorf("starting the servers: %s", string(f))
		}
	}()
	tb := tb{e: e}
	if e.net == nil {
		e.net = &network{proxies: map[string]*servers.FaultProxy{}}
	}
	n := e.net
	key := fmt.Sprint(w.remote, w.rtt)
	p := n.proxies[key]
	if p == nil {
		target := ""
		if w.remote == "s3" {
			if n.s3 == nil {
				n.s3 = servers.StartVersity(tb, filepath.Join(e.cfg.work, "img"), s3Access, s3Secret)
			}
			target = n.s3.Endpoint
		} else {
			if n.nginx == nil {
				n.nginx = servers.StartNginx(tb, e.cfg.work, false)
			}
			target = n.nginx.URL
		}
		p = servers.NewFaultProxy(tb, target)
		if w.rtt > 0 {
			p.Set(servers.Fault{Kind: servers.Delay, Delay: w.rtt})
		}
		n.proxies[key] = p
	}
	name := w.image + "/" + w.image + ".qcow2"
	get := p.URL + "/img/" + name
	t.local, t.url, t.img = t.img, get, get
	if w.remote == "s3" {
		get = p.URL + "/" + name
		t.url, t.img, t.s3 = "s3://"+name, get, p.URL
		t.vars = append(t.vars, "AWS_ACCESS_KEY_ID="+s3Access, "AWS_SECRET_ACCESS_KEY="+s3Secret, "AWS_REGION=us-east-1",
			"AWS_CONFIG_FILE=/nonexistent", "AWS_SHARED_CREDENTIALS_FILE=/nonexistent", "AWS_EC2_METADATA_DISABLED=true",
			"CURLAUTH=--aws-sigv4 aws:amz:us-east-1:s3 --user "+s3Access+":"+s3Secret+" -H x-amz-content-sha256:UNSIGNED-PAYLOAD")
	}
	t.vars = append(t.vars, "GET="+get)
	t.meters = append(t.meters, func() map[string]float64 {
		// The proxy counts a response once it has sent all of it,
		// which may be a moment after the client has it.
		n := p.BodyBytes()
		for time.Sleep(50 * time.Millisecond); p.BodyBytes() != n; time.Sleep(50 * time.Millisecond) {
			n = p.BodyBytes()
		}
		return map[string]float64{"fetched": float64(n)}
	})
	return nil
}

// tb lets the bench start test/servers' servers, which are written for
// tests: a failure panics with a tbFatal that remote returns as an error,
// and cleanups run when the bench ends. Only these methods are called.
type tb struct {
	testing.TB
	e *env
}

type tbFatal string

func (t tb) Helper()                   {}
func (t tb) Cleanup(f func())          { t.e.onClose(f) }
func (t tb) Logf(f string, a ...any)   { t.e.logf("servers: "+f, a...) }
func (t tb) Errorf(f string, a ...any) { t.e.logf("servers: "+f, a...) }
func (t tb) Fatal(a ...any)            { panic(tbFatal(fmt.Sprint(a...))) }
func (t tb) Fatalf(f string, a ...any) { panic(tbFatal(fmt.Sprintf(f, a...))) }
func (t tb) Skipf(f string, a ...any)  { t.Fatalf(f, a...) }
func (t tb) TempDir() string {
	d, err := t.e.scratch("servers")
	if err != nil {
		t.Fatal(err)
	}
	t.e.onClose(func() { os.RemoveAll(d) })
	return d
}

// fetched is what the proxy sent per byte of the image file: a reader
// that fetches only what it needs stays near the share that is data.
var fetched = metric{name: "fetched ÷ image file", unit: "x", lower: true, of: func(o *outcome) (float64, bool) {
	v, ok := o.vals["fetched"]
	return v / float64(o.fileSize), ok && o.fileSize > 0
}}

const curl = `curl -sS --fail $CURLAUTH -o "$OUT" "$GET"`

func remoteWorkloads() []*workload {
	var ws []*workload
	for _, n := range []struct {
		proto string
		rtt   time.Duration
	}{{"http", 0}, {"http", 20 * time.Millisecond}, {"s3", 20 * time.Millisecond}} {
		tag, where := n.proto+"-lo", "loopback"
		if n.rtt > 0 {
			tag, where = fmt.Sprintf("%s-%dms", n.proto, n.rtt.Milliseconds()), fmt.Sprintf("%v RTT", n.rtt)
		}
		where = map[string]string{"http": "over HTTP, ", "s3": "over S3, "}[n.proto] + where
		fuse, copiers := []string{"qcowfs", "qemu"}, []string{"curl", "convert", "qcowfs", "qemu"}
		if n.proto == "s3" { // qemu has no S3 driver
			fuse, copiers = []string{"qcowfs"}, []string{"curl", "qcowfs"}
		}
		own := map[string]string{"convert": convert, "curl": curl}
		for _, w := range []*workload{
			{id: "r-cp-plain-" + tag, title: "cp of the 2 GiB plain image " + where, image: "plain", who: copiers, cmd: cp, own: own,
				verify: sameAsRaw, metrics: []metric{took("time", "")}},
			{id: "r-cp-sparse1t-" + tag, title: "cp of the 1 TiB sparse image " + where, image: "sparse1t", who: copiers, cmd: cp, own: own,
				verify: sameAsRaw, metrics: []metric{took("time", "")}},
			{id: "r-dd-plain-" + tag, title: "dd bs=1M of the 2 GiB plain image " + where, image: "plain", who: fuse, cmd: dd,
				metrics: []metric{rate("MB/s", "", 0), cpuPerGiB}},
			{id: "r-fio-plain-" + tag, title: "fio 4 KiB random reads, 4 jobs, O_DIRECT, " + where, image: "plain", who: fuse, cmd: fioRead,
				parse: parseFio, metrics: []metric{iops, cpuPerIO}},
			{id: "r-guest-" + tag, title: "tar of every file of the guest's partition " + where, image: "guest", who: fuse,
				before: mountGst, cmd: tarGst, after: unmntGst, metrics: []metric{took("time", "")}, limit: 30 * time.Second},
		} {
			w.remote, w.rtt, w.group, w.cold = n.proto, n.rtt, "Remote", true
			if w.limit == 0 {
				w.limit = 20 * time.Second // qemu's export over curl takes minutes at 20 ms
			}
			if n.rtt > 0 && w.image != "sparse1t" && w.cmd != dd && w.cmd != fioRead {
				// Issue 34: a throwaway overlay over the remote base, a
				// hydrated image and the local file, on the copy and
				// the guest read.
				if w.cmd == tarGst {
					w.who = append(w.who, "qcowfs-overlay")
				}
				if n.proto == "http" {
					w.who = append(w.who, "qcowfs-hydrated", "qcowfs-local")
				}
			}
			w.metrics = append(w.metrics, fetched)
			if w.id == "r-cp-sparse1t-http-20ms" {
				w.quick = []string{"curl", "qcowfs"}
			}
			ws = append(ws, w)
		}
	}
	// Time to the first byte: a fresh mount of a remote image and a 4 KiB
	// read of its start, beside qemu-img info over the curl driver (which
	// reads the header and the tables it needs).
	ws = append(ws, &workload{id: "r-first-http-20ms", title: "mount and the first 4 KiB read of the plain image over HTTP, 20ms RTT, against qemu-img info",
		image: "plain", remote: "http", rtt: 20 * time.Millisecond, group: "Remote", who: []string{"qcowfs", "qemu-img"},
		cmd: `t0=$(date +%s%N); mkdir "$RUN/m" && "$BIN" mount "$IMG" "$RUN/m" && dd if="$RUN/m/plain.raw" of=/dev/null bs=4k count=1 iflag=direct status=none
r=$?; echo "@first $(( $(date +%s%N) - t0 ))e-9"; "$BIN" unmount "$RUN/m"; exit $r`,
		own:     map[string]string{"qemu-img": `t0=$(date +%s%N); qemu-img info "$IMG" > /dev/null; r=$?; echo "@first $(( $(date +%s%N) - t0 ))e-9"; exit $r`},
		metrics: []metric{took("time to first byte", "first"), fetched}, limit: 20 * time.Second})
	return ws
}
