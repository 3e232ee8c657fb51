package fs

import (
	"maps"
	"sort"
	"time"

	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/remote"
)

// What the daemon tells `qcowfs status`: the images it refuses and why,
// and what the open images are doing.

// noteRefusal records that the image at path is refused with err, or (err
// nil) that it is not.
func (m *mount) noteRefusal(path string, err error) {
	m.refMu.Lock()
	defer m.refMu.Unlock()
	if err == nil {
		delete(m.refused, path)
		return
	}
	if len(m.refused) < maxIdentities {
		m.refused[path] = err
	}
}

// noteReadOnly logs, once per image and reason, that an image of a
// writable mount is shown read-only, and why.
func (m *mount) noteReadOnly(path, why string) {
	m.refMu.Lock()
	old, seen := m.readOnly[path]
	if !seen || old != why {
		if len(m.readOnly) < maxIdentities {
			m.readOnly[path] = why
		}
	}
	m.refMu.Unlock()
	if !seen || old != why {
		m.log.Warn("image shown read-only", "image", path, "reason", why)
	}
}

// noteWritable records that the image at path is writable (again).
func (m *mount) noteWritable(path string) {
	m.refMu.Lock()
	defer m.refMu.Unlock()
	delete(m.readOnly, path)
}

// ReadOnly returns the images of a writable mount that are shown
// read-only, by path, with why and what would make them writable.
func (r *Root) ReadOnly() map[string]string {
	m := r.m
	m.refMu.Lock()
	defer m.refMu.Unlock()
	return maps.Clone(m.readOnly)
}

// backingReason is why the image that is the backing file of the image
// over is read-only.
func backingReason(over string) string {
	return "it is the backing file of " + over + ", which would change with it (write " + over + " instead, or mount with --overlay)"
}

// noteBacking records that the files of img's backing chain are read by
// the image at path: in a writable mount they are shown read-only, as
// noteImage says of those validated already.
func (m *mount) noteBacking(path string, files []fileKey) {
	var bases []string
	m.refMu.Lock()
	for _, k := range files {
		if len(m.backing) < maxIdentities {
			m.backing[k] = path
		}
		if p := m.images[k]; p != "" {
			bases = append(bases, p)
		}
	}
	m.refMu.Unlock()
	if m.cfg.Writable && m.cfg.Overlay == "" {
		for _, p := range bases {
			m.noteReadOnly(p, backingReason(path))
		}
	}
}

// noteImage records the path of the image file k, which validated: the
// image of a backing chain noted later is named by it (noteBacking).
func (m *mount) noteImage(k fileKey, path string) {
	m.refMu.Lock()
	defer m.refMu.Unlock()
	if len(m.images) < maxIdentities {
		m.images[k] = path
	}
}

// backingOf returns the image the file k is a backing file of, or "".
func (m *mount) backingOf(k fileKey) string {
	m.refMu.Lock()
	defer m.refMu.Unlock()
	return m.backing[k]
}

// maxFirstScan bounds the folders the first scan walks.
const maxFirstScan = 4096

// firstScanWait bounds how long Refused waits for the first scan: a folder
// on a disk that does not answer must not hold up the mount command.
const firstScanWait = 10 * time.Second

// Refused returns the images the mount does not show, by path, with the
// library's error (errors.Is(err, qcow2.ErrLocked), ...). The first call
// starts a scan of the whole source tree (up to maxFirstScan folders) and
// waits for it, at most firstScanWait; later calls return what the mount
// knows now.
func (r *Root) Refused() map[string]error {
	r.firstScan.Do(func() {
		done := make(chan struct{})
		go func() {
			defer close(done)
			r.walk()
		}()
		select {
		case <-done:
		case <-time.After(firstScanWait):
			r.m.log.Warn("the first scan of the source is still running; images it refuses later are logged, not reported by the mount command", "waited", firstScanWait)
		}
	})
	m := r.m
	m.refMu.Lock()
	defer m.refMu.Unlock()
	out := make(map[string]error, len(m.refused))
	for k, v := range m.refused {
		out[k] = v
	}
	return out
}

// NoImages reports that the source is a remote prefix in whose listing
// no object is a qcow2 image, and how many objects it listed: the mount
// shows an empty folder, and says why. Call it after Refused (the first
// scan probes every object).
func (r *Root) NoImages() (listed int, none bool) {
	t, ok := r.m.src.(*remoteTree)
	if !ok || t.single != "" {
		return 0, false
	}
	objects, images := t.counts()
	return objects, images == 0
}

// walk scans every folder of the source once, breadth first.
func (r *Root) walk() {
	queue := []*dirNode{&r.dirNode}
	for n := 0; len(queue) > 0 && n < maxFirstScan; n++ {
		d := queue[0]
		queue = queue[1:]
		s, err := d.scan("")
		if err != nil {
			continue
		}
		for _, x := range s.names {
			if x.kind() == kindDir {
				queue = append(queue, &dirNode{m: r.m, rel: x.e.rel})
			}
		}
	}
}

// ImageStatus is what `qcowfs status` shows of one open image (a snapshot
// of an image is one of its own, under the image's path).
type ImageStatus struct {
	Image   string `json:"image"`
	Overlay string `json:"overlay,omitempty"` // the overlay written (overlay mode), once made
	Handles int    `json:"handles"`           // open files
	Writers int    `json:"writers"`           // of them, open for writing
	// OpenForWriting says the image is open for writing: it holds a
	// writer's locks.
	OpenForWriting bool        `json:"open-for-writing"`
	Locks          qcow2.Locks `json:"locks"` // qemu's locks on the image (or overlay) file
	// ReadRequests and ReadBytes count the reads the mount answered,
	// since the image was opened.
	ReadRequests int64       `json:"read-requests"`
	ReadBytes    int64       `json:"read-bytes"`
	Reads        qcow2.Stats `json:"reads"` // what the library did for them
	// The image's failed requests since the mount.
	ErrorCounts
}

// Status is what the mount reports.
type Status struct {
	Images      []ImageStatus `json:"open-images"`
	TableHits   uint64        `json:"table-cache-hits"`
	TableMisses uint64        `json:"table-cache-misses"`
	// The failed requests of every image since the mount.
	ErrorCounts
	// Remote is the remote client's counters, for a remote source.
	Remote *remote.ClientStats `json:"remote,omitempty"`
}

// Stats returns the mount's status.
func (r *Root) Stats() any {
	m := r.m
	st := Status{Images: []ImageStatus{}}
	var errs map[string]ErrorCounts
	st.ErrorCounts, errs = m.errs.snapshot()
	st.TableHits, st.TableMisses = m.cfg.Image.Cache.Stats()
	if m.cfg.Remote != nil {
		rs := m.cfg.Remote.Stats()
		st.Remote = &rs
	}
	m.reg.mu.Lock()
	open := make([]*openImage, 0, len(m.reg.images))
	for _, oi := range m.reg.images {
		open = append(open, oi)
	}
	m.reg.mu.Unlock()
	for _, oi := range open {
		select {
		case <-oi.ready:
		default:
			continue // still opening
		}
		img := oi.image()
		if img == nil {
			continue
		}
		is := ImageStatus{Image: oi.path, Locks: img.Locks(), Reads: img.Stats(),
			ReadRequests: oi.readRequests.Load(), ReadBytes: oi.readBytes.Load(), ErrorCounts: errs[oi.path]}
		if img != oi.orig {
			is.Overlay = oi.overlay
		}
		oi.lockMu.Lock()
		is.Handles, is.Writers = oi.handles, oi.writers
		oi.lockMu.Unlock()
		is.OpenForWriting = is.Writers > 0
		st.Images = append(st.Images, is)
	}
	sort.Slice(st.Images, func(i, j int) bool { return st.Images[i].Image < st.Images[j].Image })
	return st
}
