package fs

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/remote"
)

// The open-image registry: every disk that something has open, opened once
// and shared. Its users are FUSE handles of the disk's files (the image,
// a snapshot, a partition) and the mount's own background work (counting
// data bytes, reading a partition table).
//
// Locks follow the handles, as qemu's follow its users: an image's qemu
// reader locks are taken when its first handle opens and dropped when its
// last handle closes. The mount's own work reads without locks, like
// qemu-img info -U, so a listing or a stat never gets in the way of a qemu.
// Once no user is left, the image is closed, with its cached tables: the
// next open reads the file afresh.
//
// registry.mu guards the maps only and is never held across I/O: an image
// is opened by its first user outside the lock, and users that come
// meanwhile wait for that open on the entry's ready channel. Closing is the
// same the other way: the last user closes the image outside the lock, and
// an open of the same file (of any generation) meanwhile waits for the
// close to end (closing), so that it reads what the close wrote: the
// bitmaps stored and no more in use (else an image of a writable mount
// would open read-only), the space taken ahead given back (which a writer
// opened meanwhile could have allocated). The writes of a close are the
// mount's own: the file's generation stays (identities.busy). One slow or
// broken image never holds up the others, and one that makes the library
// panic only fails its own open (the panic is logged with its stack).
// Open images are counted against the file descriptor budget
// (fdbudget.go).

type registry struct {
	mu      sync.Mutex
	images  map[diskID]*openImage // keyed by whole disk (diskID.base)
	closing map[fileKey]int       // images of each file being closed
	closed  *sync.Cond            // on mu: a close ended
}

// openImage is one open disk, shared by everything that holds it.
type openImage struct {
	d     diskID
	rel   string // the image file, relative to the source root
	path  string // and its absolute path, for messages
	ready chan struct{}
	// orig is the image file's own image, set with err before ready
	// closes: the file the disk is named after (its identity, its
	// snapshots). cur is the image served: orig itself, or in overlay
	// mode its overlay once there is one (overlay.go). An image replaced
	// in cur stays open until the last user lets go, for reads that
	// started on it.
	orig *qcow2.Image
	cur  atomic.Pointer[qcow2.Image]
	err  error
	fds  int // descriptors taken from the budget for orig and cur

	// Overlay mode: the overlay's path, and whether it still has to be
	// made (at the first write; guarded by lockMu).
	overlay string
	pending atomic.Bool

	refs int // users; guarded by registry.mu

	lockMu  sync.Mutex // guards handles, writers and the locks
	handles int
	writers int // handles open for writing: the writer's locks are held

	failed      atomic.Bool // a read failed; logged once
	writeFailed atomic.Bool // a write failed; logged once

	// Writes, discards and resizes so far, and how many of them the
	// partition table was last read after (parts.go, tableWritten).
	writes, tableRead atomic.Uint64

	// Reads answered, and their bytes, for qcowfs status.
	readRequests, readBytes atomic.Int64
}

// acquire returns the open image of disk d (the image file at rel), opening
// it if nobody has it open. Every acquire is paired with a release.
func (m *mount) acquire(d diskID, rel string) (*openImage, error) {
	d = d.base()
	r := &m.reg
	r.mu.Lock()
	oi := r.images[d]
	for oi == nil && r.closing[d.key] > 0 {
		r.closed.Wait()
		oi = r.images[d]
	}
	if oi != nil {
		oi.refs++
		r.mu.Unlock()
		<-oi.ready
		if oi.err != nil {
			m.release(oi)
			return nil, oi.err
		}
		return oi, nil
	}
	oi = &openImage{d: d, rel: rel, path: m.src.abs(rel), ready: make(chan struct{}), refs: 1}
	r.images[d] = oi
	r.mu.Unlock()

	oi.err = m.openCounted(oi)
	if oi.err == nil {
		oi.fds = oi.files()
		if err := m.fds.take(rel, oi.fds); err != nil {
			oi.close()
			oi.err, oi.fds = err, 0
			m.fdBudgetSpent(oi.path, err)
		}
	}
	close(oi.ready)
	if oi.err != nil {
		m.release(oi)
		return nil, oi.err
	}
	return oi, nil
}

// release gives up one use of oi, closing it after the last one.
func (m *mount) release(oi *openImage) {
	r := &m.reg
	r.mu.Lock()
	oi.refs--
	last := oi.refs == 0
	if last && r.images[oi.d] == oi {
		delete(r.images, oi.d)
	}
	if last && oi.orig != nil {
		r.closing[oi.d.key]++
	}
	r.mu.Unlock()
	if !last || oi.orig == nil {
		return
	}
	ours := oi.orig.Writable() && m.ids.busy(oi.d.key)
	oi.close()
	m.fds.give(oi.rel, oi.fds)
	if ours {
		v := version{}
		if st, err := m.src.stat(oi.rel); err == nil && keyOf(&st) == oi.d.key {
			v = versionOf(&st)
		}
		m.ids.closed(oi.d.key, v)
	}
	r.mu.Lock()
	if r.closing[oi.d.key]--; r.closing[oi.d.key] == 0 {
		delete(r.closing, oi.d.key)
	}
	r.closed.Broadcast()
	r.mu.Unlock()
}

// image is the image served now.
func (oi *openImage) image() *qcow2.Image { return oi.cur.Load() }

// files is how many descriptors oi's images hold.
func (oi *openImage) files() int {
	n := oi.orig.MaxFiles()
	if img := oi.image(); img != oi.orig {
		n += img.MaxFiles()
	}
	return n
}

// close closes oi's images, returning the first error.
func (oi *openImage) close() error {
	var err error
	if img := oi.image(); img != nil && img != oi.orig {
		err = img.Close()
	}
	if oi.orig != nil {
		if cerr := oi.orig.Close(); err == nil {
			err = cerr
		}
	}
	return err
}

// openCounted opens the image like openImage, turning a panic of the
// library into this image's error: whatever one image does, the others
// (and the waiters on this one) go on.
func (m *mount) openCounted(oi *openImage) (err error) {
	defer func() {
		if r := recover(); r != nil {
			m.log.Error("internal error (panic) opening an image; only this image is affected",
				"image", oi.path, "panic", fmt.Sprint(r), "stack", string(debug.Stack()))
			if oi.orig != nil {
				oi.close()
			}
			oi.orig, err = nil, fmt.Errorf("internal error opening the image: %v", r)
			oi.cur.Store(nil)
		}
	}()
	img, err := m.openImage(oi.d, oi.rel)
	if err != nil {
		return err
	}
	oi.orig = img
	oi.cur.Store(img)
	if m.cfg.Overlay != "" && oi.d.snap == 0 {
		if err := m.pickOverlay(oi); err != nil {
			oi.close()
			oi.orig = nil
			oi.cur.Store(nil)
			return err
		}
	}
	return nil
}

// fdBudgetSpent logs that an image was not opened for want of
// descriptors, at most once every ten seconds.
func (m *mount) fdBudgetSpent(path string, err error) {
	now := time.Now().UnixNano()
	last := m.fdWarned.Load()
	if now-last < int64(10*time.Second) || !m.fdWarned.CompareAndSwap(last, now) {
		return
	}
	m.log.Warn("image not opened: too many open images", "image", path, "reason", err.Error())
}

// openImage opens generation d.gen of the image file at rel, without
// locks: the file is opened through the source root, and must still be the
// file the disk names. In a writable mount the image (not a snapshot, not
// the backing file of another image) is opened for writing where it can
// be; if it cannot, it opens read-only and says why (ReadOnlyReason).
func (m *mount) openImage(d diskID, rel string) (*qcow2.Image, error) {
	// (In overlay mode the image file is only read: its overlay takes
	// the writes.)
	writable := m.cfg.Writable && m.cfg.Overlay == "" && d.snap == 0
	var why string
	if writable {
		if over := m.backingOf(d.key); over != "" {
			writable, why = false, backingReason(over)
		}
	}
	var f qcow2.HostFile
	var st syscall.Stat_t
	var err error
	if writable {
		if f, st, err = m.src.openImage(rel, true); err != nil {
			writable, why = false, "the daemon cannot open it for writing: "+err.Error()+" (give the daemon's user write permission on it)"
		}
	}
	if !writable {
		if f, st, err = m.src.openImage(rel, false); err != nil {
			return nil, err
		}
	}
	if keyOf(&st) != d.key {
		f.Close()
		return nil, syscall.ESTALE // replaced since it was looked up
	}
	opts := m.imageOptions()
	opts.SnapshotIndex = d.snap
	opts.Writable = writable
	img, err := qcow2.NewImage(f, opts)
	if err != nil {
		return nil, err
	}
	if m.cfg.Writable && m.cfg.Overlay == "" && d.snap == 0 {
		if img.Writable() {
			m.noteWritable(m.src.abs(rel))
		} else {
			if why == "" {
				why = img.ReadOnlyReason()
			}
			m.noteReadOnly(m.src.abs(rel), why)
		}
	}
	return img, nil
}

// openHandle acquires disk d for a FUSE handle: the image, locked like a
// read-only qemu while any handle has it open, and like a writing qemu
// while a handle open for writing (write) has. The file must still be in
// the generation the node stands for; if someone changed it since, the
// open fails with ESTALE and the kernel looks the name up again, finding
// a node for the new content.
func (m *mount) openHandle(d diskID, rel string, write bool) (*openImage, error) {
	oi, err := m.acquire(d, rel)
	if err != nil {
		return nil, err
	}
	since := m.ids.now()
	st, err := m.src.fileStat(oi.orig.File())
	if err == nil {
		err = m.ids.opened(d.key, d.gen, versionOf(&st), since)
	}
	if err != nil {
		m.release(oi)
		return nil, err
	}
	oi.lockMu.Lock()
	defer oi.lockMu.Unlock()
	if write && !oi.image().Writable() && !oi.pending.Load() {
		m.ids.closed(d.key, versionOf(&st))
		m.release(oi)
		return nil, syscall.EROFS
	}
	if oi.handles == 0 {
		if err := oi.image().Lock(m.cfg.ForceShare); err != nil {
			m.ids.closed(d.key, versionOf(&st))
			m.release(oi)
			return nil, err
		}
	}
	if write && oi.writers == 0 && !oi.pending.Load() {
		if err := oi.image().LockWrite(); err != nil {
			if oi.handles == 0 {
				oi.image().Unlock()
			}
			m.ids.closed(d.key, versionOf(&st))
			m.release(oi)
			return nil, err
		}
	}
	oi.handles++
	if write {
		oi.writers++
	}
	m.startHydration(d, rel)
	return oi, nil
}

// closeHandle gives up a handle's use of oi, dropping the locks with the
// last handle; the last handle open for writing flushes the image and
// drops the writer's locks.
func (m *mount) closeHandle(oi *openImage, write bool) {
	oi.lockMu.Lock()
	oi.handles--
	if write {
		oi.writers--
		if oi.writers == 0 && oi.image().Writable() {
			if err := oi.image().Flush(); err != nil {
				m.log.Error("flushing the image after its last writer closed", "image", oi.imagePath(), "err", err)
			}
			oi.image().UnlockWrite()
			m.usage.recount(oi.d)
		}
	}
	if oi.handles == 0 {
		oi.image().Unlock()
	}
	oi.lockMu.Unlock()
	st, err := m.src.fileStat(oi.orig.File())
	if err == nil {
		m.ids.closed(oi.d.key, versionOf(&st))
	} else {
		m.ids.closed(oi.d.key, version{})
	}
	m.release(oi)
}

func (m *mount) imageOptions() qcow2.Options {
	o := m.cfg.Image
	o.Warnf = func(format string, args ...any) { m.log.Warn(fmt.Sprintf(format, args...)) }
	return o
}

// openNow returns disk d's open image if it is open now (nil otherwise),
// without opening it. It counts a use (the image cannot be closed while
// the caller looks at it): the caller releases it.
func (m *mount) openNow(d diskID) *openImage {
	r := &m.reg
	r.mu.Lock()
	defer r.mu.Unlock()
	oi := r.images[d.base()]
	if oi == nil {
		return nil
	}
	select {
	case <-oi.ready:
		if oi.err == nil {
			oi.refs++
			return oi
		}
	default:
	}
	return nil
}

// writeFailed logs a failed write, fsync or discard once per open image
// (and every overlap: each one stops the image's writes), and maps the
// error.
func (m *mount) writeFailed(oi *openImage, off int64, err error) syscall.Errno {
	m.errs.note(oi.path, "write", off, err)
	switch {
	case errors.Is(err, qcow2.ErrOverlap):
		m.log.Error("write refused: it would overwrite the image's metadata; the image is marked corrupt and takes no more writes (qemu-img check -r all)", "image", oi.imagePath(), "offset", off, "err", err)
	case errors.Is(err, qcow2.ErrNoSpace):
	case !oi.writeFailed.Swap(true):
		m.log.Error("write failed; writes since the last fsync may be lost, and every later fsync of this image fails; further errors are not logged", "image", oi.imagePath(), "offset", off, "err", err)
	}
	return errnoOf(err)
}

// readFailed logs a failed read once per open image, and maps the error.
func (m *mount) readFailed(oi *openImage, off int64, err error) syscall.Errno {
	m.errs.note(oi.path, "read", off, err)
	if !oi.failed.Swap(true) {
		m.log.Error("read failed; further read errors of this image are not logged",
			"image", oi.path, "offset", off, "err", err)
	}
	return errnoOf(err)
}

// errnoOf maps a library error to the errno a reader sees: a lock another
// process holds is EBUSY; corrupt or unreadable metadata is EIO.
func errnoOf(err error) syscall.Errno {
	var errno syscall.Errno
	switch {
	case err == nil:
		return 0
	case isRemote(err):
		// A remote object that changed, timed out, went away or was
		// refused: the reader gets EIO (never EINTR for a timeout,
		// which a reader might retry for ever).
		return syscall.EIO
	case errors.Is(err, qcow2.ErrLocked):
		return syscall.EBUSY
	case errors.Is(err, qcow2.ErrNoSpace):
		return syscall.ENOSPC
	case errors.Is(err, qcow2.ErrReadOnly), errors.Is(err, qcow2.ErrOverlap):
		// (After an overlap the image is corrupt and takes no writes.)
		if errors.Is(err, qcow2.ErrOverlap) {
			return syscall.EIO
		}
		return syscall.EROFS
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return syscall.EINTR
	case errors.Is(err, qcow2.ErrBudget):
		return syscall.ENOMEM
	case errors.As(err, &errno):
		return errno
	default:
		return syscall.EIO
	}
}

// isRemote reports whether err is a failure of package remote.
func isRemote(err error) bool {
	var re *remote.Error
	return errors.As(err, &re)
}

// closeAll writes back and closes every image still open, when the mount
// is gone (a lazy unmount leaves handles the kernel never releases).
func (m *mount) closeAll() {
	r := &m.reg
	r.mu.Lock()
	open := make([]*openImage, 0, len(r.images))
	for _, oi := range r.images {
		open = append(open, oi)
	}
	clear(r.images)
	r.mu.Unlock()
	for _, oi := range open {
		<-oi.ready
		if oi.orig != nil {
			if err := oi.close(); err != nil {
				m.log.Error("closing the image at unmount", "image", oi.path, "err", err)
			}
		}
	}
	// And the images their last users are closing now.
	r.mu.Lock()
	for len(r.closing) > 0 {
		r.closed.Wait()
	}
	r.mu.Unlock()
}
