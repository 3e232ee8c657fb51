package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// A target is one contestant's view of a workload's image in one run: set
// up by setup, torn down by closeTarget before the run is verified.
type target struct {
	dir      string // the run's own folder: mount points, logs, fio state
	img      string // the qcow2 image (the raw file's fresh raw image), or its URL
	raw      string // the image's raw twin
	url      string // remote: what a mount reads (http:// or s3://)
	local    string // remote: the image's local file
	s3       string // remote over S3: the endpoint
	key      string // an encrypted image's passphrase file
	writable bool
	size     int64 // the image's virtual size
	fileSize int64 // its file's size

	file   string   // what the command reads or writes ($FILE)
	mnt    string   // the FUSE mount point, if any
	pid    int      // the daemon serving file, 0 without one
	vars   []string // the commands' variables
	meters []func() map[string]float64
	vals   map[string]float64 // what closing found (the probe's counts)
	hung   bool               // a command timed out on it: abort, do not ask
	downs  []func() error
	files  []string // removed once the run is verified: its folder, its output
}

func (t *target) down(f func() error) { t.downs = append(t.downs, f) }

// setup makes w's image ready for c's run: the run's folder, the image (a
// fresh one to write, a cached one, or its URL), c's mount when c runs
// w's command on $FILE, and the commands' variables:
//
//	FILE  the file the command reads or writes (a mount's, or the raw file)
//	IMG   the qcow2 image (a remote one's URL; a fresh raw file for the raw file)
//	FMT   IMG's format; RAW the image's raw twin; SIZE its virtual size
//	OUT   a file for the command's output; RUN the run's folder
//	BIN   the contestant's program; FIOTIME fio's run time
//	KEY   the passphrase file of an encrypted image, else empty
func (e *env) setup(w *workload, c *contestant) (*target, error) {
	dir, err := e.scratch(w.id + "-" + strings.ReplaceAll(c.id, "@", "-"))
	if err != nil {
		return nil, err
	}
	t := &target{dir: dir, vals: map[string]float64{}, files: []string{dir}}
	root := e.cfg.work
	if w.tmpfs {
		if root, err = e.tmpfsCopy(w.image); err != nil {
			return t, err
		}
	}
	img := w.image
	switch {
	case w.encrypted && c.clear && img != "":
		img = twinOf(img) // the same data unencrypted
	case w.encrypted && !c.clear:
		t.key = e.key()
	}
	if img != "" {
		t.img = filepath.Join(root, "img", img, img+".qcow2")
		t.raw = filepath.Join(root, "raw", twinOf(w.image)+".raw")
		t.size, t.fileSize = fileSize(t.raw), fileSize(t.img)
	}
	format := "qcow2"
	if c.format != "" {
		format = c.format
	}
	if w.fresh != 0 {
		t.writable, t.img = true, filepath.Join(dir, "img", "disk."+format)
		opts := ""
		if w.prealloc {
			opts = "-o preallocation=full"
		}
		if t.key != "" {
			opts = `--object secret,id=s0,file="$KEY" -o encrypt.format=luks,encrypt.key-secret=s0`
		}
		// sync: the last run's writeback is not this run's.
		script := `mkdir -p "$(dirname "$IMG")"; luks qemu-img create -q -f "$FMT" ` + opts + ` "$IMG" "$SIZE"; sync`
		if _, err := e.sh(script, "IMG="+t.img, "FMT="+format, "KEY="+t.key, fmt.Sprintf("SIZE=%d", w.fresh)); err != nil {
			return t, err
		}
		if w.image == "" {
			t.size = w.fresh
		}
	}
	if w.remote != "" {
		if err := e.remote(w, t); err != nil {
			return t, err
		}
	}
	out := filepath.Join(dir, "out")
	if !w.outDisk {
		if out, err = e.tmpfsDir(); err != nil {
			return t, err
		}
		out = filepath.Join(out, "out-"+filepath.Base(dir))
		t.files = append(t.files, out)
	}
	t.vars = append(t.vars, "IMG="+t.img, "FMT="+format, "KEY="+t.key, "RAW="+t.raw, "OUT="+out, "RUN="+dir,
		"BIN="+c.bin, fmt.Sprintf("SIZE=%d", t.size), fmt.Sprintf("FIOTIME=%.0fs", e.cfg.fioTime.Seconds()),
		"TREE="+filepath.Join(e.cfg.work, "src", "tree.tar"))
	if c.mount != nil && strings.Contains(w.before+w.command(c)+w.after, "$FILE") {
		if err := c.mount(e, t, c); err != nil {
			return t, err
		}
	}
	if t.pid != 0 {
		t.meters = append(t.meters, daemonMeter(t.pid))
	}
	t.vars = append(t.vars, "FILE="+t.file, fmt.Sprintf("PID=%d", t.pid))
	if w.after != "" { // runs first at teardown, also after a failure
		t.down(func() error {
			e.run(job{script: w.after, vars: t.vars, limit: time.Minute, cleanup: true})
			return nil
		})
	}
	return t, nil
}

// closeTarget tears t down, last set up first: its FUSE connection aborted
// first if a command on it timed out, whatever a killed command left last.
func (e *env) closeTarget(t *target) error {
	if t.hung && t.mnt != "" {
		e.abortFUSE(t.mnt)
	}
	var errs []string
	for i := len(t.downs) - 1; i >= 0; i-- {
		if err := t.downs[i](); err != nil {
			errs = append(errs, err.Error())
		}
	}
	t.downs = nil
	e.sweep(t.dir)
	if len(errs) > 0 {
		return fmt.Errorf("tearing down: %s", strings.Join(errs, "; "))
	}
	return nil
}

// tmpfsDir mounts a tmpfs under the work folder once; the final sweep
// unmounts it.
func (e *env) tmpfsDir() (string, error) {
	dir := filepath.Join(e.cfg.work, "tmpfs")
	if e.tmpfs {
		return dir, nil
	}
	if _, err := e.sh(`mkdir -p "$D" && mount -t tmpfs -o size=12g,mode=0755 qcowfs-bench "$D"`, "D="+dir); err != nil {
		return "", err
	}
	e.tmpfs = true
	return dir, nil
}

// tmpfsCopy copies an image and its raw twin to the tmpfs, once, and
// returns the tmpfs.
func (e *env) tmpfsCopy(name string) (string, error) {
	dir, err := e.tmpfsDir()
	if err != nil {
		return "", err
	}
	_, err = e.sh(`[ -e "$D/img/$N/$N.qcow2" ] && exit 0
mkdir -p "$D/img/$N" "$D/raw"
cp --sparse=always "$W/img/$N/$N.qcow2" "$D/img/$N/"
cp --sparse=always "$W/raw/$R.raw" "$D/raw/"`, "D="+dir, "W="+e.cfg.work, "N="+name, "R="+twinOf(name))
	return dir, err
}

func fileSize(p string) int64 {
	st, err := os.Stat(p)
	if err != nil {
		return 0
	}
	return st.Size()
}
