// Package luks reads and writes the LUKS1 header qemu embeds in encrypted
// images (qemu's crypto/block-luks.c, after cryptsetup's LUKS1 on-disk
// format), unlocks its master key with a passphrase, and encrypts and
// decrypts 512-byte sectors the way qemu does: the ciphers, modes, IV
// generators and hashes qemu 7.2 can create that Go's standard library and
// golang.org/x/crypto implement. It knows nothing of qcow2: the caller
// reads the header area and says which sector number each sector has.
//
// Hostile headers are refused before any work they would demand: every
// offset, length, stripe count and iteration count is bounded (see the
// limits below), so unlocking costs at most MaxIterations PBKDF2 rounds
// per active key slot.
package luks

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
)

// SectorSize is the unit of encryption: every sector is encrypted on its
// own, with an IV made from its number.
const SectorSize = 512

// Limits on what a header may demand.
const (
	// MaxIterations bounds the PBKDF2 iterations of a key slot and of
	// the master key digest: 2^25, four times what qemu's default
	// iter-time (2 s) gave on the machine these were measured on
	// (8.5 million; docs/design.md, "Encryption"). Opening a slot at the
	// limit takes about 15 s here.
	MaxIterations = 1 << 25
	// MaxStripes bounds a key slot's anti-forensic stripes (qemu and
	// cryptsetup make 4000).
	MaxStripes = 1 << 16
	// MaxKeyBytes bounds the master key (qemu's largest: 64 bytes, for
	// AES-256 in XTS mode).
	MaxKeyBytes = 128
	// MaxHeaderBytes bounds the header area with its key material.
	MaxHeaderBytes = 64 << 20
)

// HeaderLen is the length of the LUKS1 header proper (the phdr), before
// any key material: the bytes Parse reads.
const HeaderLen = 592

const (
	magic          = "LUKS\xba\xbe"
	headerLen      = HeaderLen
	numSlots       = 8
	slotLen        = 48
	saltLen        = 32
	digestLen      = 20
	slotActive     = 0x00AC71F3
	slotInactive   = 0x0000DEAD
	keySlotOffset  = 4096 // where qemu puts the first slot's key material
	defaultStripes = 4000
)

// Header is a LUKS1 header, its fields named as in the format (all
// big-endian on disk).
type Header struct {
	CipherName    string // "aes"
	CipherMode    string // "xts-plain64", "cbc-essiv:sha256"
	HashSpec      string // "sha256"
	PayloadOffset uint32 // in sectors: where the encrypted data would start
	KeyBytes      uint32 // master key length
	MKDigest      [digestLen]byte
	MKDigestSalt  [saltLen]byte
	MKDigestIter  uint32
	UUID          string
	Slots         [numSlots]Slot
}

// Slot is a key slot: an encrypted, anti-forensically split copy of the
// master key.
type Slot struct {
	Active     bool
	Iterations uint32
	Salt       [saltLen]byte
	KeyOffset  uint32 // in sectors from the header's start
	Stripes    uint32
}

// A FormatError reports a malformed or hostile header field.
type FormatError struct {
	Field string
	Value uint64
	Msg   string
}

func (e *FormatError) Error() string {
	return fmt.Sprintf("LUKS header: %s = %d: %s", e.Field, e.Value, e.Msg)
}

// An UnsupportedError names a cipher, mode, IV generator or hash the header
// asks for and this package cannot provide.
type UnsupportedError struct {
	What, Name string
}

func (e *UnsupportedError) Error() string {
	return fmt.Sprintf("LUKS %s %q is not supported", e.What, e.Name)
}

// ErrWrongPassphrase means no active key slot opens with the passphrase.
var ErrWrongPassphrase = errors.New("wrong passphrase: no key slot opens with it")

// Parse decodes and checks the header at the start of b, a header area of
// areaLen bytes (key material included). It checks what qemu checks
// (magic, version, slot states, stripes, key material inside the area and
// before the payload, slots that do not overlap) and the limits above.
// Whether this package implements the cipher is Unlock's question (and
// Supported's): a header it cannot open can still be described.
func Parse(b []byte, areaLen int64) (*Header, error) {
	if len(b) < headerLen {
		return nil, &FormatError{"header length", uint64(len(b)), fmt.Sprintf("shorter than a LUKS header (%d bytes)", headerLen)}
	}
	if string(b[:6]) != magic {
		return nil, &FormatError{"magic", uint64(binary.BigEndian.Uint32(b)), "not a LUKS header"}
	}
	if v := binary.BigEndian.Uint16(b[6:]); v != 1 {
		return nil, &UnsupportedError{"version", fmt.Sprint(v)}
	}
	if areaLen > MaxHeaderBytes {
		return nil, &FormatError{"header area length", uint64(areaLen), fmt.Sprintf("more than %d bytes", MaxHeaderBytes)}
	}
	str := func(p []byte) string { return string(bytes.TrimRight(p, "\x00")) }
	h := &Header{
		CipherName:    str(b[8:40]),
		CipherMode:    str(b[40:72]),
		HashSpec:      str(b[72:104]),
		PayloadOffset: binary.BigEndian.Uint32(b[104:]),
		KeyBytes:      binary.BigEndian.Uint32(b[108:]),
		MKDigestIter:  binary.BigEndian.Uint32(b[164:]),
		UUID:          str(b[168:208]),
	}
	copy(h.MKDigest[:], b[112:132])
	copy(h.MKDigestSalt[:], b[132:164])
	if h.KeyBytes == 0 || h.KeyBytes > MaxKeyBytes {
		return nil, &FormatError{"key_bytes", uint64(h.KeyBytes), fmt.Sprintf("not between 1 and %d", MaxKeyBytes)}
	}
	if h.MKDigestIter == 0 || h.MKDigestIter > MaxIterations {
		return nil, &FormatError{"mk_digest_iter", uint64(h.MKDigestIter), fmt.Sprintf("not between 1 and %d", MaxIterations)}
	}
	if int64(h.PayloadOffset)*SectorSize > areaLen {
		return nil, &FormatError{"payload_offset", uint64(h.PayloadOffset), fmt.Sprintf("past the header area (%d bytes)", areaLen)}
	}
	for i := range h.Slots {
		s := b[208+i*slotLen:]
		slot := &h.Slots[i]
		state := binary.BigEndian.Uint32(s)
		slot.Iterations = binary.BigEndian.Uint32(s[4:])
		copy(slot.Salt[:], s[8:40])
		slot.KeyOffset = binary.BigEndian.Uint32(s[40:])
		slot.Stripes = binary.BigEndian.Uint32(s[44:])
		field := func(f string) string { return fmt.Sprintf("key slot %d %s", i, f) }
		switch state {
		case slotActive:
			slot.Active = true
		case slotInactive:
		default:
			return nil, &FormatError{field("active"), uint64(state), "neither active nor inactive"}
		}
		if slot.Stripes == 0 || slot.Stripes > MaxStripes {
			return nil, &FormatError{field("stripes"), uint64(slot.Stripes), fmt.Sprintf("not between 1 and %d", MaxStripes)}
		}
		if slot.Active && (slot.Iterations == 0 || slot.Iterations > MaxIterations) {
			return nil, &FormatError{field("iterations"), uint64(slot.Iterations), fmt.Sprintf("not between 1 and %d", MaxIterations)}
		}
		end := int64(slot.KeyOffset) + h.materialSectors(slot.Stripes)
		if end > int64(h.PayloadOffset) || end*SectorSize > areaLen {
			return nil, &FormatError{field("key_material_offset"), uint64(slot.KeyOffset), fmt.Sprintf("its key material ends at sector %d, past the payload (sector %d) or the header area (%d bytes)", end, h.PayloadOffset, areaLen)}
		}
	}
	for i := range h.Slots {
		for j := i + 1; j < numSlots; j++ {
			a, c := &h.Slots[i], &h.Slots[j]
			if int64(a.KeyOffset) < int64(c.KeyOffset)+h.materialSectors(c.Stripes) && int64(c.KeyOffset) < int64(a.KeyOffset)+h.materialSectors(a.Stripes) {
				return nil, &FormatError{fmt.Sprintf("key slot %d key_material_offset", j), uint64(c.KeyOffset), fmt.Sprintf("overlaps key slot %d", i)}
			}
		}
	}
	return h, nil
}

// Supported says why this package cannot open the header's volumes (a
// cipher, mode, IV generator or hash it does not implement), or nil.
func (h *Header) Supported() error {
	_, err := h.spec()
	return err
}

// materialSectors is the space a slot's key material takes, as qemu and
// cryptsetup count it: the split key rounded up to sectors, then to the
// header's 8 sectors.
func (h *Header) materialSectors(stripes uint32) int64 {
	n := (int64(h.KeyBytes)*int64(stripes) + SectorSize - 1) / SectorSize
	const align = keySlotOffset / SectorSize
	return (n + align - 1) / align * align
}

// Marshal encodes the header into its 592 bytes.
func (h *Header) Marshal() []byte {
	b := make([]byte, headerLen)
	copy(b, magic)
	binary.BigEndian.PutUint16(b[6:], 1)
	copy(b[8:40], h.CipherName)
	copy(b[40:72], h.CipherMode)
	copy(b[72:104], h.HashSpec)
	binary.BigEndian.PutUint32(b[104:], h.PayloadOffset)
	binary.BigEndian.PutUint32(b[108:], h.KeyBytes)
	copy(b[112:132], h.MKDigest[:])
	copy(b[132:164], h.MKDigestSalt[:])
	binary.BigEndian.PutUint32(b[164:], h.MKDigestIter)
	copy(b[168:208], h.UUID)
	for i, slot := range h.Slots {
		s := b[208+i*slotLen:]
		state := uint32(slotInactive)
		if slot.Active {
			state = slotActive
		}
		binary.BigEndian.PutUint32(s, state)
		binary.BigEndian.PutUint32(s[4:], slot.Iterations)
		copy(s[8:40], slot.Salt[:])
		binary.BigEndian.PutUint32(s[40:], slot.KeyOffset)
		binary.BigEndian.PutUint32(s[44:], slot.Stripes)
	}
	return b
}

// Spec is what a header's cipher specification says, in qemu's names
// (QCryptoBlockInfoLUKS).
type Spec struct {
	CipherAlg    string // "aes-256"
	CipherMode   string // "xts"
	IvgenAlg     string // "plain64"
	IvgenHashAlg string // "sha256" with essiv, else ""
	HashAlg      string // "sha256"
}

// Spec describes the header's cipher; it does not check that this package
// implements it (info describes what it cannot open).
func (h *Header) Spec() Spec {
	var s Spec
	s.CipherMode, s.IvgenAlg, _ = strings.Cut(h.CipherMode, "-")
	s.IvgenAlg, s.IvgenHashAlg, _ = strings.Cut(s.IvgenAlg, ":")
	bits := h.KeyBytes * 8
	if s.CipherMode == "xts" {
		bits /= 2 // XTS splits the key in two
	}
	s.CipherAlg = fmt.Sprintf("%s-%d", h.CipherName, bits)
	s.HashAlg = h.HashSpec
	return s
}
