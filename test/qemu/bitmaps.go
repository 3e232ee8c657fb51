package qemu

import (
	"encoding/json"
	"net"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// DirtyRanges asks qemu which ranges of the persistent bitmap name of the
// qcow2 image are dirty, the way backup tools ask: qemu-nbd exports the
// image read-only with the bitmap (-B), and qemu-img map reads the
// bitmap's block status through x-dirty-bitmap, where a dirty range is one
// with "data": false. Adjacent ranges are merged.
func DirtyRanges(t testing.TB, image, name string) [][2]int64 {
	t.Helper()
	opts, stop := ServeBitmap(t, image, name)
	defer stop()
	out := Img(t, "map", "--output=json", "--image-opts", opts)
	var entries []struct {
		Start, Length int64
		Data          bool
	}
	if err := json.Unmarshal(out, &entries); err != nil {
		t.Fatalf("qemu-img map: %v\n%s", err, out)
	}
	var dirty [][2]int64
	for _, e := range entries {
		if e.Data {
			continue
		}
		if n := len(dirty); n > 0 && dirty[n-1][1] == e.Start {
			dirty[n-1][1] = e.Start + e.Length
			continue
		}
		dirty = append(dirty, [2]int64{e.Start, e.Start + e.Length})
	}
	return dirty
}

// ServeBitmap exports the qcow2 image read-only with its persistent bitmap
// name (qemu-nbd -r -B NAME on a unix socket, for any number of clients
// in turn) until stop, and returns the --image-opts under which qemu-img
// reads the bitmap's block status: the export's URL is
// "nbd+unix://?socket=" and the socket's path (NBDFile).
func ServeBitmap(t testing.TB, image, name string) (opts string, stop func()) {
	t.Helper()
	Require(t, "qemu-nbd", "qemu-img")
	sock := filepath.Join(t.TempDir(), "nbd.sock")
	nbd := exec.Command("qemu-nbd", "-t", "-r", "-k", sock, "-B", name, "-f", "qcow2", image)
	var stderr limitedBuffer
	nbd.Stderr = &stderr
	if err := nbd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { nbd.Wait(); close(exited) }()
	stop = func() {
		nbd.Process.Kill()
		<-exited
	}
	// qemu-nbd listens once it has opened the image: wait for the socket
	// to take a connection (or the process to fail).
	deadline := time.Now().Add(20 * time.Second)
	for {
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			stop()
			t.Fatalf("qemu-nbd -B %s %s did not listen: %s", name, image, stderr.String())
		}
		select {
		case <-exited:
			t.Fatalf("qemu-nbd -B %s %s: %s", name, image, stderr.String())
		case <-time.After(10 * time.Millisecond):
		}
	}
	return "driver=nbd,server.type=unix,server.path=" + sock + ",x-dirty-bitmap=qemu:dirty-bitmap:" + name, stop
}

// ExportsBitmap reports whether qemu-nbd -r -B name exports the image with
// its bitmap, which qemu-img map then reads, or refuses it (qemu-nbd
// listens before it opens the image, and exits with an error).
func ExportsBitmap(t testing.TB, image, name string) bool {
	t.Helper()
	Require(t, "qemu-nbd", "qemu-img")
	sock := filepath.Join(t.TempDir(), "nbd.sock")
	nbd := exec.Command("qemu-nbd", "-t", "-r", "-k", sock, "-B", name, "-f", "qcow2", image)
	if err := nbd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { nbd.Wait(); close(exited) }()
	defer func() {
		nbd.Process.Kill()
		<-exited
	}()
	deadline := time.After(20 * time.Second)
	for {
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			break
		}
		select {
		case <-exited:
			return false
		case <-deadline:
			t.Fatalf("qemu-nbd -B %s %s neither listens nor exits", name, image)
		case <-time.After(10 * time.Millisecond):
		}
	}
	err := exec.Command("qemu-img", "map", "--output=json", "--image-opts",
		"driver=nbd,server.type=unix,server.path="+sock+",x-dirty-bitmap=qemu:dirty-bitmap:"+name).Run()
	return err == nil
}

// NBDFile is the file name qemu-img map prints for what ServeBitmap's
// opts export: "nbd+unix://?socket=" and the socket's path.
func NBDFile(opts string) string {
	for _, kv := range strings.Split(opts, ",") {
		if p, ok := strings.CutPrefix(kv, "server.path="); ok {
			return "nbd+unix://?socket=" + p
		}
	}
	return ""
}

// limitedBuffer keeps the first 4 KiB written to it.
type limitedBuffer struct {
	mu sync.Mutex
	b  []byte
}

func (l *limitedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if room := 4096 - len(l.b); room > 0 {
		l.b = append(l.b, p[:min(room, len(p))]...)
	}
	return len(p), nil
}

func (l *limitedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return string(l.b)
}
