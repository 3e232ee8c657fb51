package luks

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/md5"
	"crypto/sha1"
	"crypto/sha256"
	"crypto/sha512"
	"crypto/subtle"
	"encoding/binary"
	"fmt"
	"hash"
	"strings"

	// Legacy algorithms, deprecated for new designs: qemu offers them for
	// LUKS headers, so existing images may use them.
	//lint:ignore SA1019 qemu's LUKS offers CAST5
	"golang.org/x/crypto/cast5"
	//lint:ignore SA1019 qemu's LUKS offers RIPEMD-160
	"golang.org/x/crypto/ripemd160"
	//lint:ignore SA1019 qemu's LUKS offers Twofish
	"golang.org/x/crypto/twofish"
)

// The sector cipher: a block cipher in a mode, with an IV per sector from
// an IV generator, as qemu's qcrypto_block_cipher_{en,de}crypt_helper
// drive it: each 512-byte sector on its own, its IV made from its number.

// spec is a header's cipher specification, resolved to implementations.
type spec struct {
	newBlock  func(key []byte) (cipher.Block, error)
	keyLen    int // bytes of key for newBlock
	mode      string
	ivgen     string
	ivHash    func() hash.Hash // essiv's hash
	essivAlg  func(key []byte) (cipher.Block, error)
	hash      func() hash.Hash // PBKDF2's and the AF splitter's
	blockSize int
}

// hashes are the hashes qemu's LUKS accepts that Go implements (qemu's
// QCryptoHashAlgorithm names).
var hashes = map[string]func() hash.Hash{
	"md5": md5.New, "sha1": sha1.New, "sha224": sha256.New224, "sha256": sha256.New,
	"sha384": sha512.New384, "sha512": sha512.New, "ripemd160": ripemd160.New,
}

// ciphers are the block ciphers qemu's LUKS accepts that Go implements,
// with their key sizes (qemu's qcrypto_block_luks_cipher_size_map).
var ciphers = map[string]struct {
	sizes []int
	new   func(key []byte) (cipher.Block, error)
}{
	"aes":     {[]int{16, 24, 32}, aes.NewCipher},
	"cast5":   {[]int{16}, func(k []byte) (cipher.Block, error) { return cast5.NewCipher(k) }},
	"twofish": {[]int{16, 24, 32}, func(k []byte) (cipher.Block, error) { return twofish.NewCipher(k) }},
}

// spec resolves the header's cipher specification, or says which part of
// it is not supported (serpent, sm4, sm3, an unknown mode...).
func (h *Header) spec() (*spec, error) {
	s := &spec{}
	var ok bool
	if s.hash, ok = hashes[h.HashSpec]; !ok {
		return nil, &UnsupportedError{"hash", h.HashSpec}
	}
	mode, ivgen, _ := strings.Cut(h.CipherMode, "-")
	ivgen, ivHash, _ := strings.Cut(ivgen, ":")
	s.mode, s.ivgen = mode, ivgen
	switch mode {
	case "ecb", "cbc", "xts", "ctr":
	default:
		return nil, &UnsupportedError{"cipher mode", h.CipherMode}
	}
	c, ok := ciphers[h.CipherName]
	if !ok {
		return nil, &UnsupportedError{"cipher", h.CipherName}
	}
	s.keyLen = int(h.KeyBytes)
	if mode == "xts" {
		s.keyLen /= 2
	}
	sized := false
	for _, n := range c.sizes {
		sized = sized || n == s.keyLen && (mode != "xts" || int(h.KeyBytes) == 2*n)
	}
	if !sized {
		return nil, &UnsupportedError{"cipher", fmt.Sprintf("%s with a %d-byte key", h.CipherName, h.KeyBytes)}
	}
	s.newBlock = c.new
	b, err := c.new(make([]byte, s.keyLen))
	if err != nil {
		return nil, err
	}
	s.blockSize = b.BlockSize()
	if mode == "xts" && s.blockSize != 16 {
		return nil, &UnsupportedError{"cipher mode", h.CipherName + " in xts"}
	}
	switch ivgen {
	case "plain", "plain64":
	case "essiv":
		if s.ivHash, ok = hashes[ivHash]; !ok {
			return nil, &UnsupportedError{"IV generator hash", ivHash}
		}
		// ESSIV keys a cipher of the same family with the hash of the
		// master key: its key size is the digest's (dm-crypt's quirk,
		// qcrypto_block_luks_essiv_cipher).
		digest := s.ivHash().Size()
		fits := false
		for _, n := range c.sizes {
			fits = fits || n == digest
		}
		if !fits {
			return nil, &UnsupportedError{"IV generator", fmt.Sprintf("essiv:%s with %s", ivHash, h.CipherName)}
		}
		s.essivAlg = c.new
	default:
		if mode == "ecb" && ivgen == "" {
			break
		}
		return nil, &UnsupportedError{"IV generator", ivgen}
	}
	return s, nil
}

// Cipher encrypts and decrypts sectors with a master key. It is safe for
// concurrent use. Close clears its key material.
type Cipher struct {
	s      *spec
	key    []byte       // the master key (Close clears it)
	b1, b2 cipher.Block // the data cipher; XTS's tweak cipher
	essiv  cipher.Block
	niv    int
}

// newCipher makes the sector cipher of spec s with master key key (which
// it keeps: the caller must not reuse it).
func newCipher(s *spec, key []byte) (*Cipher, error) {
	c := &Cipher{s: s, key: key}
	var err error
	switch s.mode {
	case "xts":
		if c.b1, err = s.newBlock(key[:s.keyLen]); err != nil {
			return nil, err
		}
		if c.b2, err = s.newBlock(key[s.keyLen:]); err != nil {
			return nil, err
		}
	default:
		if c.b1, err = s.newBlock(key); err != nil {
			return nil, err
		}
	}
	if s.mode != "ecb" {
		c.niv = s.blockSize
	}
	if s.ivgen == "essiv" {
		h := s.ivHash()
		h.Write(key)
		salt := h.Sum(nil)
		c.essiv, err = s.essivAlg(salt)
		clear(salt)
		if err != nil {
			return nil, err
		}
	}
	return c, nil
}

// MasterKey returns a copy of the cipher's master key (the caller clears
// it), for a caller that keeps unlocked keys (qcow2.KeyCache).
func (c *Cipher) MasterKey() []byte { return append([]byte(nil), c.key...) }

// Cipher makes the sector cipher of the header's volumes from a master
// key found before (MasterKey of a cipher Unlock returned for the same
// header), without PBKDF2 and without checking it against the digest. It
// keeps a copy of key.
func (h *Header) Cipher(key []byte) (*Cipher, error) {
	s, err := h.spec()
	if err != nil {
		return nil, err
	}
	if len(key) != int(h.KeyBytes) {
		return nil, fmt.Errorf("LUKS: a master key of %d bytes for a header of %d", len(key), h.KeyBytes)
	}
	return newCipher(s, append([]byte(nil), key...))
}

// Close clears the master key. The cipher must not be used after.
func (c *Cipher) Close() {
	if c != nil {
		clear(c.key)
	}
}

// iv computes the IV of sector n into iv (len niv).
func (c *Cipher) iv(iv []byte, n uint64) {
	if len(iv) == 0 {
		return // ECB has none
	}
	clear(iv)
	switch c.s.ivgen {
	case "plain":
		binary.LittleEndian.PutUint32(iv, uint32(n))
	case "plain64":
		binary.LittleEndian.PutUint64(iv, n)
	case "essiv":
		var in [32]byte
		bs := c.essiv.BlockSize()
		binary.LittleEndian.PutUint64(in[:], n)
		var out [32]byte
		c.essiv.Encrypt(out[:bs], in[:bs])
		copy(iv, out[:min(bs, len(iv))])
	}
}

// Decrypt decrypts buf in place; its first sector has number sector. buf
// is whole sectors, but for key material, whose last sector may be cut
// short (to a multiple of the cipher's block size), as qemu's helper cuts
// it.
func (c *Cipher) Decrypt(buf []byte, sector uint64) { c.crypt(buf, sector, false) }

// Encrypt encrypts buf in place, as Decrypt decrypts it.
func (c *Cipher) Encrypt(buf []byte, sector uint64) { c.crypt(buf, sector, true) }

func (c *Cipher) crypt(buf []byte, sector uint64, enc bool) {
	var ivb [16]byte
	iv := ivb[:c.niv]
	for off := 0; off < len(buf); off, sector = off+SectorSize, sector+1 {
		s := buf[off:min(off+SectorSize, len(buf))]
		c.iv(iv, sector)
		switch c.s.mode {
		case "xts":
			xts(c.b1, c.b2, s, iv, enc)
		case "cbc":
			if enc {
				cipher.NewCBCEncrypter(c.b1, iv).CryptBlocks(s, s)
			} else {
				cbcDecrypt(c.b1, s, iv)
			}
		case "ctr":
			cipher.NewCTR(c.b1, iv).XORKeyStream(s, s)
		case "ecb":
			bs := c.s.blockSize
			for i := 0; i+bs <= len(s); i += bs {
				if enc {
					c.b1.Encrypt(s[i:i+bs], s[i:i+bs])
				} else {
					c.b1.Decrypt(s[i:i+bs], s[i:i+bs])
				}
			}
		}
	}
}

// xts en- or decrypts one sector in place in XTS mode (IEEE P1619) with
// the 16-byte tweak iv: the tweak is encrypted with k2, and each block is
// whitened with it before and after k1, the tweak multiplied by x in
// GF(2^128) from block to block. (golang.org/x/crypto/xts takes only
// 64-bit sector numbers as tweaks; ESSIV makes full 16-byte ones.) The
// block and the tweak are handled as two 64-bit words.
func xts(k1, k2 cipher.Block, s, iv []byte, enc bool) {
	var t [16]byte
	k2.Encrypt(t[:], iv)
	lo := binary.LittleEndian.Uint64(t[:8])
	hi := binary.LittleEndian.Uint64(t[8:])
	crypt := k1.Decrypt
	if enc {
		crypt = k1.Encrypt
	}
	for i := 0; i+16 <= len(s); i += 16 {
		b := s[i : i+16 : i+16]
		binary.LittleEndian.PutUint64(b[:8], binary.LittleEndian.Uint64(b[:8])^lo)
		binary.LittleEndian.PutUint64(b[8:], binary.LittleEndian.Uint64(b[8:])^hi)
		crypt(b, b)
		binary.LittleEndian.PutUint64(b[:8], binary.LittleEndian.Uint64(b[:8])^lo)
		binary.LittleEndian.PutUint64(b[8:], binary.LittleEndian.Uint64(b[8:])^hi)
		// t *= x: a left shift of the little-endian 128-bit number,
		// reduced by x^128 + x^7 + x^2 + x + 1.
		carry := hi >> 63
		hi = hi<<1 | lo>>63
		lo = lo<<1 ^ carry*0x87
	}
}

// cbcDecrypt decrypts one sector in place in CBC mode: each block is
// decrypted and whitened with the ciphertext before it (the IV first).
// (cipher.NewCBCDecrypter would allocate per sector; on amd64 it has no
// faster path than this.)
func cbcDecrypt(b cipher.Block, s, iv []byte) {
	bs := b.BlockSize()
	var prev, cur [16]byte
	copy(prev[:bs], iv)
	for i := 0; i+bs <= len(s); i += bs {
		blk := s[i : i+bs : i+bs]
		copy(cur[:bs], blk)
		b.Decrypt(blk, blk)
		subtle.XORBytes(blk, blk, prev[:bs])
		prev = cur
	}
}

// LegacyAES is the cipher of qemu's old qcow2 encryption (crypt_method 1,
// "aes"): AES-128 in CBC mode with plain64 IVs, keyed with the first 16
// bytes of the passphrase (zero-padded; qemu stops at a NUL byte). Its
// sectors are numbered by guest offset.
func LegacyAES(passphrase []byte) (*Cipher, error) {
	key := make([]byte, 16)
	if i := bytes.IndexByte(passphrase, 0); i >= 0 {
		passphrase = passphrase[:i]
	}
	copy(key, passphrase)
	h := &Header{CipherName: "aes", CipherMode: "cbc-plain64", HashSpec: "sha256", KeyBytes: 16}
	s, err := h.spec()
	if err != nil {
		return nil, err
	}
	return newCipher(s, key)
}
