package qcow2

import (
	"bytes"
	"errors"
	"fmt"

	"github.com/qcowfs/qcowfs/luks"
)

// Encrypted images (crypt_method 1, qemu's legacy AES, and 2, LUKS).
//
// A LUKS image keeps a LUKS1 header in clusters of its own, named by the
// full disk encryption header pointer extension; its master key is
// unlocked with the passphrase Options.Passphrase gives for the file
// (package luks). Data clusters hold ciphertext, each 512-byte sector
// encrypted with an IV from its number: for LUKS the sector's host offset
// in the image (or data) file, for the legacy format its guest offset
// (qemu's crypt_physical_offset). So a cluster that moves is decrypted
// with its old offsets and encrypted with its new ones: copy-on-write
// reads through ReadAt (plaintext) and writes through the writer's door
// (hostwrite.go), which encrypts. Compressed clusters are never
// encrypted: qemu reads them as they are (and cannot write them), and so
// does this package. Zero clusters and unallocated ones read zeros
// without a host read, as in any image; but a host range that merely
// reads zeros is no zero data any more (it decrypts to noise), so the
// writer never skips copying zeros into such a range, and block status
// never asks the host file for holes.
//
// The legacy format is read only, as qemu's system emulators no longer
// write it.

// layerCrypt is an encrypted layer's cipher.
type layerCrypt struct {
	c        *luks.Cipher
	physical bool         // IVs from host offsets (LUKS), not guest offsets
	header   *luks.Header // LUKS: the header (no key material in it)
}

// Encryption returns what an image made to be this one's encrypted
// overlay is made with: the same cipher and PBKDF2 costs (so that it opens
// as fast as this one), under passphrase. ok is false if the image is not
// encrypted; for qemu's legacy AES it is qemu's LUKS defaults.
func (img *Image) Encryption(passphrase []byte) (e *Encryption, ok bool) {
	lc := img.top.crypt
	if lc == nil {
		return nil, false
	}
	e = &Encryption{Passphrase: passphrase}
	if h := lc.header; h != nil {
		e.Params = luks.Params{Spec: h.Spec(), MKDigestIter: h.MKDigestIter}
		for _, s := range h.Slots {
			if s.Active {
				e.Params.Iterations = s.Iterations
				break
			}
		}
	}
	return e, true
}

// unlock makes the layer's cipher from the passphrase opts gives for its
// file. The passphrase is cleared once used.
func (l *layer) unlock(opts *Options) error {
	// What the header says is checked before the passphrase is asked
	// for: a damaged header or a cipher this package lacks is the
	// reason given, whatever the key.
	h := l.hdr
	var area []byte
	var lh *luks.Header
	off, n := int64(h.CryptoHeaderOffset), int64(h.CryptoHeaderLength)
	if h.CryptMethod != cryptAES {
		if err := l.budget.add(n, "LUKS header"); err != nil {
			return err
		}
		defer l.budget.sub(n)
		var err error
		if area, lh, err = readLUKSHeader(l.file, h, n); err != nil {
			return err
		}
		defer clear(area)
		if err := lh.Supported(); err != nil {
			return luksError(l.name, off, err)
		}
	}
	var pass []byte
	if opts.Passphrase != nil {
		pass = opts.Passphrase(l.name)
	}
	defer clear(pass)
	if pass == nil {
		return &KeyError{File: l.name, Missing: true}
	}
	// qemu refuses a secret holding a NUL byte (it is not valid UTF-8 to
	// glib): no image of its making has such a passphrase. Callers
	// refuse one (cmd/qcowfs, internal/keys); here it ends at the NUL,
	// as the C string qemu would pass on.
	if i := bytes.IndexByte(pass, 0); i >= 0 {
		pass = pass[:i]
	}
	if h.CryptMethod == cryptAES {
		c, err := luks.LegacyAES(pass)
		if err != nil {
			return err
		}
		l.crypt = &layerCrypt{c: c}
		return nil
	}
	var id [32]byte
	if opts.KeyCache != nil {
		id = keyID(area, pass)
		if mk := opts.KeyCache.get(id); mk != nil {
			c, err := lh.Cipher(mk)
			clear(mk)
			if err != nil {
				return luksError(l.name, off, err)
			}
			l.crypt = &layerCrypt{c: c, physical: true, header: lh}
			return nil
		}
	}
	c, err := unlockLUKS(lh, bytes.NewReader(area), pass)
	switch {
	case errors.Is(err, luks.ErrWrongPassphrase):
		return &KeyError{File: l.name}
	case err != nil:
		return luksError(l.name, off, err)
	}
	if opts.KeyCache != nil {
		opts.KeyCache.put(id, c.MasterKey())
	}
	l.crypt = &layerCrypt{c: c, physical: true, header: lh}
	return nil
}

// readLUKSHeader reads the first n bytes (at most all) of the LUKS header
// area that header h's crypto header extension names in f, and parses
// them as the start of that area (luks.Parse bounds every field against
// the whole area). Unlocking reads the whole area, for its key material;
// describing an image reads luks.HeaderLen bytes. readHeader has checked
// that the area lies inside the file and within luks.MaxHeaderBytes.
func readLUKSHeader(f HostFile, h *Header, n int64) ([]byte, *luks.Header, error) {
	off, areaLen := int64(h.CryptoHeaderOffset), int64(h.CryptoHeaderLength)
	area := make([]byte, min(n, areaLen))
	if err := readFull(f, area, off, "LUKS header"); err != nil {
		return nil, nil, err
	}
	lh, err := luks.Parse(area, areaLen)
	if err != nil {
		clear(area)
		return nil, nil, luksError(f.Name(), off, err)
	}
	return area, lh, nil
}

// unlockLUKS is luks.Header.Unlock, the PBKDF2 work of an open; tests
// count its calls (export_test.go).
var unlockLUKS = (*luks.Header).Unlock

// luksError names the file in an error of package luks: a malformed
// header is corrupt, a cipher it does not implement unsupported.
func luksError(file string, off int64, err error) error {
	var fe *luks.FormatError
	var ue *luks.UnsupportedError
	switch {
	case errors.As(err, &fe):
		return &FormatError{File: file, Field: "LUKS " + fe.Field, Value: fe.Value, Offset: off, Msg: fe.Msg}
	case errors.As(err, &ue):
		return &UnsupportedError{File: file, Feature: "encryption: " + ue.Error()}
	}
	return fmt.Errorf("%s: LUKS header: %w", file, err)
}

// sector returns the number of the sector at host offset host, guest
// offset guest, as the layer's IVs count them.
func (lc *layerCrypt) sector(host, guest int64) uint64 {
	if lc.physical {
		return uint64(host) / luks.SectorSize
	}
	return uint64(guest) / luks.SectorSize
}

// readDecrypted reads guest data stored at host offset off (guest offset
// guest) into p and decrypts it: whole sectors are read and decrypted,
// in p where p is aligned, else through a buffer.
func (l *layer) readDecrypted(p []byte, off, guest int64) error {
	const ss = luks.SectorSize
	head := off % ss
	if head == 0 && len(p)%ss == 0 {
		if err := l.readHost(p, off); err != nil {
			return err
		}
		l.crypt.c.Decrypt(p, l.crypt.sector(off, guest))
		return nil
	}
	n := (head + int64(len(p)) + ss - 1) / ss * ss
	bp := getBuf(int(n))
	defer putBuf(bp)
	buf := (*bp)[:n]
	if err := l.readHost(buf, off-head); err != nil {
		return err
	}
	l.crypt.c.Decrypt(buf, l.crypt.sector(off-head, guest-head))
	copy(p, buf[head:])
	return nil
}

// encrypted returns a copy of b, guest data for host offset off,
// encrypted, in a buffer of the pool (the caller puts it back). b and off
// are whole sectors.
func (lc *layerCrypt) encrypted(b []byte, off int64) *[]byte {
	bp := getBuf(len(b))
	buf := (*bp)[:len(b)]
	copy(buf, b)
	lc.c.Encrypt(buf, lc.sector(off, 0))
	return bp
}

// writeSectors writes p at guest offset off of an encrypted image, in
// whole sectors: a sector is encrypted as a whole, so one the write covers
// only in part is read (decrypted), merged and written whole. The sectors
// are held against the image's other writes (w.rmw) from that read to
// the write, so that two writes into one sector cannot undo each other.
func (w *writer) writeSectors(p []byte, off int64) (int, error) {
	const ss = luks.SectorSize
	a, b := off&^(ss-1), (off+int64(len(p))+ss-1)&^(ss-1)
	w.rmw.lock(a, b)
	defer w.rmw.unlock(a, b, true)
	if a == off && b == off+int64(len(p)) {
		return w.writeRuns(p, off)
	}
	bp := getBuf(int(b - a))
	defer putBuf(bp)
	buf := (*bp)[:b-a]
	if a != off {
		if _, err := w.img.ReadAt(buf[:ss], a); err != nil {
			return 0, err
		}
	}
	if end := off + int64(len(p)); end != b && (b-ss != a || a == off) {
		if _, err := w.img.ReadAt(buf[b-a-ss:], b-ss); err != nil {
			return 0, err
		}
	}
	copy(buf[off-a:], p)
	n, err := w.writeRuns(buf, a)
	return int(min(int64(len(p)), max(0, int64(n)-(off-a)))), err
}
