package fs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/remote"
)

// Overlay mode (Config.Overlay): the image files of the source are opened
// read-only and never written. The first write to an image makes its
// overlay, OVERLAY/REL (REL being the image's path below the source), a
// qcow2 image whose backing file is the original, with format qcow2, of
// the same virtual and cluster size, and, if the original is encrypted,
// LUKS-encrypted with its passphrase, cipher and PBKDF2 costs
// (qcow2.Image.Encryption), so that the guest's data never lands in the
// clear (the image options' Passphrase gives the overlay, named
// OVERLAY/REL, the original's passphrase when it opens): made under a
// temporary name, synced, renamed into place (never over a file) and its
// folder synced, so that a crash leaves no half-made overlay. The original
// is named by absolute path, or for a remote source by its URL (without
// credentials: qemu's curl driver opens an http(s) one as it is; an s3://
// one only qcowfs opens), and an overlay of a remote image records the
// version of its base (overlaybase.go). From then on the overlay is
// served: writes go to it, reads fall through to the original where it has
// nothing. A later mount with the same folder picks the overlay up, after
// checking that it still names the original (and, remote, that the
// original is the version it was made on).
//
// The original stays open beside its overlay (openImage.orig): it is the
// file the disk is named after, whose identity and snapshots the listing
// shows, and reads that started before the overlay was made finish on it.

// overlayPath is where the overlay of the image at rel lives.
func (m *mount) overlayPath(rel string) string {
	return filepath.Join(m.cfg.Overlay, filepath.FromSlash(rel))
}

// pickOverlay sets up overlay mode for oi, whose original is open: it
// opens the overlay if one exists, or marks it pending.
func (m *mount) pickOverlay(oi *openImage) error {
	oi.overlay = m.overlayPath(oi.rel)
	img, err := m.openOverlay(oi)
	if errors.Is(err, os.ErrNotExist) {
		oi.pending.Store(true)
		return nil
	}
	if err != nil {
		return err
	}
	oi.cur.Store(img)
	return nil
}

// openOverlay opens oi's existing overlay for writing; an error wrapping
// os.ErrNotExist if there is none. The overlay must be a regular file (no
// symlink is followed) naming oi's original as its backing file, in
// format qcow2, and be at least as large.
func (m *mount) openOverlay(oi *openImage) (*qcow2.Image, error) {
	fd, err := unix.Open(oi.overlay, unix.O_RDWR|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
	if err != nil {
		if err == unix.ELOOP {
			return nil, fmt.Errorf("overlay %s: is a symlink; overlays must be regular files", oi.overlay)
		}
		return nil, &os.PathError{Op: "open overlay", Path: oi.overlay, Err: err}
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
		unix.Close(fd)
		return nil, fmt.Errorf("overlay %s: not a regular file", oi.overlay)
	}
	hf, err := qcow2.NewFile(os.NewFile(uintptr(fd), oi.overlay))
	if err != nil {
		return nil, err
	}
	opts := m.imageOptions()
	opts.Writable = true
	opts.Opener = &overlayOpener{m: m, oi: oi, next: m.opener()}
	img, err := qcow2.NewImage(hf, opts)
	if err != nil {
		return nil, fmt.Errorf("overlay %s of %s: %w (remove it to start again from the original, or mount with another --overlay folder)", oi.overlay, oi.path, err)
	}
	h := img.Header()
	var why string
	switch {
	case !m.src.names(oi.rel, h.BackingFile):
		why = fmt.Sprintf("its backing file is %q, not the original %q", shownName(h.BackingFile), oi.path)
	case h.BackingFormat != "qcow2":
		why = fmt.Sprintf("its backing format is %q, not \"qcow2\"", h.BackingFormat)
	case img.Size() < oi.orig.Size():
		why = fmt.Sprintf("its virtual size %d is smaller than the original's %d", img.Size(), oi.orig.Size())
	case !img.Writable():
		why = "it cannot be written: " + img.ReadOnlyReason()
	case oi.orig.Header().CryptMethod != 0 && h.CryptMethod == 0:
		why = "the original is encrypted and the overlay is not"
	}
	if why != "" {
		img.Close()
		return nil, fmt.Errorf("overlay %s does not belong to %s: %s (remove it to start again from the original, or mount with another --overlay folder)", oi.overlay, oi.path, why)
	}
	if err := m.checkBase(oi, img); err != nil {
		img.Close()
		return nil, err
	}
	return img, nil
}

// shownName is a backing file name as messages show it: a URL without
// credentials.
func shownName(name string) string {
	if remote.IsURL(name) {
		return remote.Redact(name)
	}
	return name
}

// writeTarget is the image a write of oi changes: its overlay in overlay
// mode, made now if this is the image's first write.
func (m *mount) writeTarget(oi *openImage) (*qcow2.Image, error) {
	if !oi.pending.Load() {
		return oi.image(), nil
	}
	oi.lockMu.Lock()
	defer oi.lockMu.Unlock()
	if !oi.pending.Load() {
		return oi.image(), nil
	}
	img, err := m.makeOverlay(oi)
	if err != nil {
		m.log.Error("cannot make the overlay; the write fails", "image", oi.path, "overlay", oi.overlay, "err", err)
		return nil, err
	}
	// The overlay takes the locks of the handles open now.
	if oi.handles > 0 {
		if err := img.Lock(m.cfg.ForceShare); err != nil {
			img.Close()
			return nil, err
		}
	}
	if oi.writers > 0 {
		if err := img.LockWrite(); err != nil {
			img.Close()
			return nil, err
		}
	}
	n := img.MaxFiles()
	if err := m.fds.take(oi.rel, n); err != nil {
		img.Close()
		m.fdBudgetSpent(oi.path, err)
		return nil, err
	}
	oi.fds += n
	oi.cur.Store(img)
	oi.pending.Store(false)
	if oi.handles > 0 {
		// The overlay's chain holds the reader's locks on the
		// original now.
		oi.orig.Unlock()
	}
	m.log.Info("overlay made: writes of the image go to it", "image", oi.path, "overlay", oi.overlay)
	return img, nil
}

// makeOverlay creates oi's overlay (unless another mount just did) and
// opens it.
func (m *mount) makeOverlay(oi *openImage) (*qcow2.Image, error) {
	img, err := m.openOverlay(oi)
	if !errors.Is(err, os.ErrNotExist) {
		return img, err
	}
	dir := filepath.Dir(oi.overlay)
	if err := mkdirSynced(dir); err != nil {
		return nil, err
	}
	removeStaleTemps(oi.overlay)
	h := oi.orig.Header()
	co := qcow2.CreateOptions{
		Size:          oi.orig.Size(),
		ClusterSize:   h.ClusterSize(),
		Backing:       m.src.backingName(oi.rel),
		BackingFormat: "qcow2",
		ExtendedL2:    h.ExtendedL2(),
		Extensions:    baseRecord(oi),
	}
	if h.CryptMethod != 0 {
		// The original opened, so its passphrase is known.
		var pass []byte
		if m.cfg.Image.Passphrase != nil {
			pass = m.cfg.Image.Passphrase(oi.path)
		}
		defer clear(pass)
		if pass == nil {
			return nil, &qcow2.KeyError{File: oi.overlay, Missing: true}
		}
		co.Encrypt, _ = oi.orig.Encryption(pass)
	}
	p, err := qcow2.Prepare(oi.overlay, co)
	if err != nil {
		return nil, err
	}
	m.testHook("overlay-prepared")
	if err := p.Publish(); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, err
	}
	return m.openOverlay(oi)
}

// removeStaleTemps removes temporary files a crash left while making the
// overlay at path (qcow2.Prepare's ".NAME.tmp-*").
func removeStaleTemps(path string) {
	dir, base := filepath.Dir(path), filepath.Base(path)
	names, _ := filepath.Glob(filepath.Join(dir, "."+escapeGlob(base)+".tmp-*"))
	for _, n := range names {
		os.Remove(n)
	}
}

func escapeGlob(s string) string {
	r := strings.NewReplacer(`\`, `\\`, `*`, `\*`, `?`, `\?`, `[`, `\[`)
	return r.Replace(s)
}

// mkdirSynced makes dir and its missing parents, syncing the folder that
// receives each new one, so that an overlay published in it survives a
// crash.
func mkdirSynced(dir string) error {
	if st, err := os.Stat(dir); err == nil {
		if !st.IsDir() {
			return fmt.Errorf("%s: not a folder", dir)
		}
		return nil
	}
	parent := filepath.Dir(dir)
	if parent != dir {
		if err := mkdirSynced(parent); err != nil {
			return err
		}
	}
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	d, err := os.Open(parent)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// testHook runs Config.TestHook at a named point, if set.
func (m *mount) testHook(point string) {
	if m.cfg.TestHook != nil {
		m.cfg.TestHook(point)
	}
}

// opener is the mount's opener of backing and data files.
func (m *mount) opener() qcow2.Opener {
	if m.cfg.Image.Opener != nil {
		return m.cfg.Image.Opener
	}
	return &qcow2.LocalOpener{AllowedDirs: m.cfg.Image.AllowedDirs}
}

// overlayOpener opens the files an overlay names: its backing file must be
// its original, opened through the source tree and checked to be the
// very file the disk stands for (a remote one: the object at the URL the
// listing shows, whose version checkBase compares); an overlay names no
// data file. The
// original's own backing and data files are opened as for any image.
type overlayOpener struct {
	m    *mount
	oi   *openImage
	next qcow2.Opener
}

func (o *overlayOpener) Open(image qcow2.HostFile, field, name string) (qcow2.HostFile, error) {
	if image.Name() != o.oi.overlay {
		return o.next.Open(image, field, name)
	}
	refuse := func(reason string) error {
		return &qcow2.RefusedError{File: o.oi.overlay, Field: field, Name: name, Reason: reason}
	}
	if field != "backing file" {
		return nil, refuse("an overlay has no data file of its own")
	}
	if !o.m.src.names(o.oi.rel, name) {
		return nil, refuse(fmt.Sprintf("the overlay does not belong to %s, which it must name as its backing file", o.oi.path))
	}
	f, st, err := o.m.src.openImage(o.oi.rel, false)
	if err != nil {
		return nil, err
	}
	if keyOf(&st) != o.oi.d.key {
		f.Close()
		return nil, syscall.ESTALE // the original was replaced meanwhile
	}
	return f, nil
}

// imagePath is the path of the file oi's writes go to: the overlay once
// there is one, else the image file.
func (oi *openImage) imagePath() string {
	if oi.overlay != "" && oi.image() != oi.orig {
		return oi.overlay
	}
	return oi.path
}
