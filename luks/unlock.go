package luks

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/subtle"
	"encoding/binary"
	"fmt"
	"hash"
	"io"
	"sync"
	"time"
)

// Unlock finds the master key with passphrase: for each active key slot,
// in order, the slot key is derived from the passphrase (PBKDF2), the
// slot's key material read from r (the header area) and decrypted with it,
// merged (the anti-forensic splitter), and checked against the master key
// digest. The passphrase's bytes are taken as they are, as qemu takes a
// secret's. It returns ErrWrongPassphrase when no slot opens.
func (h *Header) Unlock(r io.ReaderAt, passphrase []byte) (*Cipher, error) {
	s, err := h.spec()
	if err != nil {
		return nil, err
	}
	for i := range h.Slots {
		slot := &h.Slots[i]
		if !slot.Active {
			continue
		}
		mk, err := h.tryslot(s, slot, r, passphrase)
		if err != nil {
			return nil, fmt.Errorf("LUKS key slot %d: %w", i, err)
		}
		if mk != nil {
			return newCipher(s, mk)
		}
	}
	return nil, ErrWrongPassphrase
}

// tryslot returns the master key the slot holds for passphrase, or nil if
// the passphrase does not open it.
func (h *Header) tryslot(s *spec, slot *Slot, r io.ReaderAt, passphrase []byte) ([]byte, error) {
	n := int(h.KeyBytes)
	material := make([]byte, n*int(slot.Stripes))
	defer clear(material)
	if _, err := r.ReadAt(material, int64(slot.KeyOffset)*SectorSize); err != nil {
		return nil, fmt.Errorf("reading the key material at sector %d: %w", slot.KeyOffset, err)
	}
	slotKey := pbkdf2(s.hash, passphrase, slot.Salt[:], int(slot.Iterations), n)
	sc, err := newCipher(s, slotKey)
	if err != nil {
		return nil, err
	}
	// The material is encrypted as a payload would be, sectors from 0
	// (its tail may be part of a sector: 24-byte keys).
	sc.Decrypt(material, 0)
	sc.Close()
	mk := make([]byte, n)
	afMerge(s.hash, n, int(slot.Stripes), material, mk)
	digest := pbkdf2(s.hash, mk, h.MKDigestSalt[:], int(h.MKDigestIter), digestLen)
	if subtle.ConstantTimeCompare(digest, h.MKDigest[:]) != 1 {
		clear(mk)
		return nil, nil
	}
	return mk, nil
}

// pbkdf2 derives n bytes from password and salt (RFC 8018, with HMAC of
// newHash). The blocks of the key are independent chains, derived in
// parallel: an XTS master key (64 bytes) with SHA-256 is two.
func pbkdf2(newHash func() hash.Hash, password, salt []byte, iter, n int) []byte {
	size := newHash().Size()
	blocks := (n + size - 1) / size
	out := make([]byte, blocks*size)
	var wg sync.WaitGroup
	for b := range blocks {
		wg.Go(func() {
			prf := hmac.New(newHash, password)
			prf.Write(salt)
			var ctr [4]byte
			binary.BigEndian.PutUint32(ctr[:], uint32(b+1))
			prf.Write(ctr[:])
			t := out[b*size : (b+1)*size]
			u := prf.Sum(nil)
			copy(t, u)
			for range iter - 1 {
				prf.Reset()
				prf.Write(u)
				u = prf.Sum(u[:0])
				for i := range t {
					t[i] ^= u[i]
				}
			}
			clear(u)
		})
	}
	wg.Wait()
	key := make([]byte, n)
	copy(key, out)
	clear(out)
	return key
}

// afMerge joins the stripes of split (each blockLen bytes) into out
// (qemu's qcrypto_afsplit_decode): d = H(d ^ s_i) for all but the last
// stripe, then out = d ^ s_last.
func afMerge(newHash func() hash.Hash, blockLen, stripes int, split, out []byte) {
	d := make([]byte, blockLen)
	defer clear(d)
	for i := 0; i < stripes-1; i++ {
		subtle.XORBytes(d, d, split[i*blockLen:(i+1)*blockLen])
		diffuse(newHash, d)
	}
	subtle.XORBytes(out, d, split[(stripes-1)*blockLen:stripes*blockLen])
}

// afSplit is afMerge's inverse: stripes-1 random stripes, and the last one
// that makes them merge to key.
func afSplit(newHash func() hash.Hash, key []byte, stripes int) ([]byte, error) {
	n := len(key)
	split := make([]byte, n*stripes)
	if _, err := rand.Read(split[:n*(stripes-1)]); err != nil {
		return nil, err
	}
	d := make([]byte, n)
	defer clear(d)
	for i := 0; i < stripes-1; i++ {
		subtle.XORBytes(d, d, split[i*n:(i+1)*n])
		diffuse(newHash, d)
	}
	subtle.XORBytes(split[(stripes-1)*n:], d, key)
	return split, nil
}

// diffuse hashes block in place, digest-sized piece by piece, each piece
// hashed with its big-endian index first (the last piece cut to fit).
func diffuse(newHash func() hash.Hash, block []byte) {
	h := newHash()
	size := h.Size()
	var ctr [4]byte
	var sum []byte
	for i := 0; i*size < len(block); i++ {
		piece := block[i*size : min((i+1)*size, len(block))]
		binary.BigEndian.PutUint32(ctr[:], uint32(i))
		h.Reset()
		h.Write(ctr[:])
		h.Write(piece)
		sum = h.Sum(sum[:0])
		copy(piece, sum)
	}
}

// Params choose what Create makes; the zero value of a field means
// qemu's default.
type Params struct {
	Spec                       // "" fields: aes-256 xts plain64 sha256
	Iterations   uint32        // key slot 0's PBKDF2 iterations; 0: measured for IterTime
	MKDigestIter uint32        // the master key digest's; 0: measured for IterTime/8
	IterTime     time.Duration // 0: 2 s, as qemu's iter-time
	Stripes      uint32        // 0: 4000
}

// Create makes a header area for a new encrypted volume, laid out as
// qemu lays it out (the header, then 8 key slots' material each aligned
// to 4 KiB, then the payload): slot 0 holds a random master key under
// passphrase. It returns the area (PayloadOffset sectors) and the cipher
// of the master key.
func Create(p Params, passphrase []byte) ([]byte, *Header, *Cipher, error) {
	if p.CipherAlg == "" {
		p.CipherAlg, p.CipherMode, p.IvgenAlg, p.HashAlg = "aes-256", "xts", "plain64", "sha256"
	}
	if p.IterTime == 0 {
		p.IterTime = 2 * time.Second
	}
	if p.Stripes == 0 {
		p.Stripes = defaultStripes
	}
	h := &Header{HashSpec: p.HashAlg}
	name, bits, ok := cutLast(p.CipherAlg)
	if !ok {
		return nil, nil, nil, &UnsupportedError{"cipher", p.CipherAlg}
	}
	h.CipherName = name
	h.KeyBytes = uint32(bits / 8)
	if p.CipherMode == "xts" {
		h.KeyBytes *= 2
	}
	h.CipherMode = p.CipherMode + "-" + p.IvgenAlg
	if p.IvgenHashAlg != "" {
		h.CipherMode += ":" + p.IvgenHashAlg
	}
	s, err := h.spec()
	if err != nil {
		return nil, nil, nil, err
	}
	mk := make([]byte, h.KeyBytes)
	if _, err := rand.Read(mk); err != nil {
		return nil, nil, nil, err
	}
	if _, err := rand.Read(h.MKDigestSalt[:]); err != nil {
		return nil, nil, nil, err
	}
	h.MKDigestIter = p.MKDigestIter
	if h.MKDigestIter == 0 {
		h.MKDigestIter = measure(s.hash, len(mk), p.IterTime/8)
	}
	copy(h.MKDigest[:], pbkdf2(s.hash, mk, h.MKDigestSalt[:], int(h.MKDigestIter), digestLen))
	var uuid [16]byte
	rand.Read(uuid[:])
	uuid[6] = uuid[6]&0x0f | 0x40
	uuid[8] = uuid[8]&0x3f | 0x80
	h.UUID = fmt.Sprintf("%x-%x-%x-%x-%x", uuid[0:4], uuid[4:6], uuid[6:8], uuid[8:10], uuid[10:])

	// The layout: slot i's material at 4 KiB + i * its aligned size.
	per := h.materialSectors(p.Stripes)
	const first = keySlotOffset / SectorSize
	for i := range h.Slots {
		h.Slots[i] = Slot{KeyOffset: uint32(first + int64(i)*per), Stripes: p.Stripes}
	}
	h.PayloadOffset = uint32(first + numSlots*per)
	area := make([]byte, int64(h.PayloadOffset)*SectorSize)

	slot := &h.Slots[0]
	slot.Active = true
	if _, err := rand.Read(slot.Salt[:]); err != nil {
		return nil, nil, nil, err
	}
	slot.Iterations = p.Iterations
	if slot.Iterations == 0 {
		slot.Iterations = max(measure(s.hash, len(mk), p.IterTime), 1000)
	}
	slotKey := pbkdf2(s.hash, passphrase, slot.Salt[:], int(slot.Iterations), len(mk))
	sc, err := newCipher(s, slotKey)
	if err != nil {
		return nil, nil, nil, err
	}
	split, err := afSplit(s.hash, mk, int(p.Stripes))
	if err != nil {
		return nil, nil, nil, err
	}
	sc.Encrypt(split, 0)
	sc.Close()
	copy(area[int64(slot.KeyOffset)*SectorSize:], split)
	clear(split)
	copy(area, h.Marshal())
	c, err := newCipher(s, mk)
	if err != nil {
		return nil, nil, nil, err
	}
	return area, h, c, nil
}

func cutLast(alg string) (string, int, bool) {
	for i := len(alg) - 1; i >= 0; i-- {
		if alg[i] == '-' {
			var bits int
			_, err := fmt.Sscan(alg[i+1:], &bits)
			return alg[:i], bits, err == nil
		}
	}
	return "", 0, false
}

// measure returns how many PBKDF2 iterations of a keyLen-byte key take d
// here, as qemu's qcrypto_pbkdf2_count_iters measures them.
func measure(newHash func() hash.Hash, keyLen int, d time.Duration) uint32 {
	const probe = 1 << 16
	start := time.Now()
	pbkdf2(newHash, []byte("measure"), make([]byte, saltLen), probe, keyLen)
	per := time.Since(start) / probe
	if per <= 0 {
		per = 1
	}
	return uint32(min(int64(d/per), MaxIterations/4))
}
