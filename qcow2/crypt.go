package qcow2

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"strings"
)

// Encrypted images. This package cannot decrypt, so Open refuses them;
// DescribeEncrypted still says what qemu-img info says of them: the
// header's facts and the encryption's parameters, read from the LUKS
// header that the crypto header extension points at (specification,
// "Full disk encryption header pointer"; the LUKS1 on-disk format).

// Encrypt is qemu's "encrypt" object (QCryptoBlockInfo): the format, and
// for LUKS the header's parameters.
type Encrypt struct {
	Format string `json:"format"` // "aes" or "luks"
	*LUKSInfo
}

// LUKSInfo is QCryptoBlockInfoLUKS, with qemu's names.
type LUKSInfo struct {
	CipherAlg      string     `json:"cipher-alg"`
	CipherMode     string     `json:"cipher-mode"`
	IvgenAlg       string     `json:"ivgen-alg"`
	IvgenHashAlg   string     `json:"ivgen-hash-alg,omitempty"`
	HashAlg        string     `json:"hash-alg"`
	PayloadOffset  int64      `json:"payload-offset"`
	MasterKeyIters uint32     `json:"master-key-iters"`
	UUID           string     `json:"uuid"`
	Slots          []LUKSSlot `json:"slots"`
}

// LUKSSlot is one key slot; Iters and Stripes are only given for an
// active slot.
type LUKSSlot struct {
	Active    bool    `json:"active"`
	Iters     *uint32 `json:"iters,omitempty"`
	Stripes   *uint32 `json:"stripes,omitempty"`
	KeyOffset int64   `json:"key-offset"`
}

// luks1 layout: the fields of the LUKS1 phdr (all big-endian), and the
// key slot states.
const (
	luksMagic        = "LUKS\xba\xbe"
	luksHeaderLen    = 592
	luksSlots        = 8
	luksSlotLen      = 48
	luksSlotActive   = 0x00AC71F3
	luksSlotInactive = 0x0000DEAD
	luksSectorSize   = 512
)

// hideCrypt reads a file with its crypt_method field (bytes 32-35) read as
// zero, so that the header parser validates everything else.
type hideCrypt struct{ r io.ReaderAt }

func (h hideCrypt) ReadAt(p []byte, off int64) (int, error) {
	n, err := h.r.ReadAt(p, off)
	for i := int64(32); i < 36; i++ {
		if j := i - off; j >= 0 && j < int64(n) {
			p[j] = 0
		}
	}
	return n, err
}

// DescribeEncrypted describes the encrypted qcow2 image at path as
// qemu-img info does, without the snapshot and bitmap lists (which would
// need the image opened). It fails with ErrNotEncrypted for an image that
// is not encrypted.
func DescribeEncrypted(path string) (Info, error) {
	f, err := os.Open(path)
	if err != nil {
		return Info{}, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return Info{}, err
	}
	var method [4]byte
	if _, err := f.ReadAt(method[:], 32); err != nil {
		return Info{}, fmt.Errorf("%s: %w", path, ErrNotQcow2)
	}
	hf, err := NewFile(f)
	if err != nil {
		return Info{}, err
	}
	h, err := readHeader(ReaderFile(hideCrypt{f}, st.Size(), path), st.Size())
	if err != nil {
		return Info{}, err
	}
	h.CryptMethod = binary.BigEndian.Uint32(method[:])
	info := headerInfo(h, path, hf)
	info.Encrypted = true
	enc := &Encrypt{}
	switch h.CryptMethod {
	case cryptNone:
		return Info{}, fmt.Errorf("%s: %w", path, ErrNotEncrypted)
	case cryptAES:
		enc.Format = "aes"
	case cryptLUKS:
		enc.Format = "luks"
		off, length, err := cryptoHeader(f, h)
		if err != nil {
			return Info{}, err
		}
		if enc.LUKSInfo, err = readLUKS(f, path, off, length); err != nil {
			return Info{}, err
		}
	default:
		return Info{}, &FormatError{File: path, Field: fieldCryptMethod.name, Value: uint64(h.CryptMethod), Offset: fieldCryptMethod.off, Msg: "unknown encryption method"}
	}
	info.FormatSpecific.Data.Encrypt = enc
	return info, nil
}

// cryptoHeader finds the full disk encryption header pointer extension
// (0x0537be77): where the LUKS header lies in the image file.
func cryptoHeader(f *os.File, h *Header) (off, length int64, err error) {
	buf := make([]byte, h.ClusterSize())
	n, _ := f.ReadAt(buf, 0)
	buf = buf[:n]
	for p := int64(h.HeaderLength); p+8 <= int64(len(buf)); {
		typ := binary.BigEndian.Uint32(buf[p:])
		l := int64(binary.BigEndian.Uint32(buf[p+4:]))
		if typ == extEnd || p+8+l > int64(len(buf)) {
			break
		}
		if typ == extCryptoHeader {
			if l < 16 {
				return 0, 0, &FormatError{File: f.Name(), Field: "crypto header extension length", Value: uint64(l), Offset: p + 4, Msg: "shorter than 16 bytes"}
			}
			return int64(binary.BigEndian.Uint64(buf[p+8:])), int64(binary.BigEndian.Uint64(buf[p+16:])), nil
		}
		p += 8 + (l+7)&^7
	}
	return 0, 0, &FormatError{File: f.Name(), Field: "crypt_method", Value: cryptLUKS, Offset: 32, Msg: "LUKS encryption without a crypto header extension"}
}

// readLUKS reads a LUKS1 header at off (length bytes reserved for it).
func readLUKS(f *os.File, name string, off, length int64) (*LUKSInfo, error) {
	if length < luksHeaderLen {
		return nil, &FormatError{File: name, Field: "crypto header length", Value: uint64(length), Offset: -1, Msg: fmt.Sprintf("shorter than a LUKS header (%d bytes)", luksHeaderLen)}
	}
	b := make([]byte, luksHeaderLen)
	if _, err := f.ReadAt(b, off); err != nil {
		return nil, &FormatError{File: name, Field: "crypto header offset", Value: uint64(off), Offset: -1, Msg: "LUKS header not readable: " + err.Error()}
	}
	if string(b[:6]) != luksMagic {
		return nil, &FormatError{File: name, Field: "LUKS magic", Value: uint64(binary.BigEndian.Uint32(b)), Offset: off, Msg: "not a LUKS header"}
	}
	if v := binary.BigEndian.Uint16(b[6:]); v != 1 {
		return nil, &UnsupportedError{File: name, Feature: fmt.Sprintf("LUKS version %d", v)}
	}
	str := func(p []byte) string { return string(bytes.TrimRight(p, "\x00")) }
	cipher, mode, hash := str(b[8:40]), str(b[40:72]), str(b[72:104])
	keyBytes := binary.BigEndian.Uint32(b[108:])
	info := &LUKSInfo{
		HashAlg:        hash,
		PayloadOffset:  int64(binary.BigEndian.Uint32(b[104:])) * luksSectorSize,
		MasterKeyIters: binary.BigEndian.Uint32(b[164:]),
		UUID:           str(b[168:208]),
	}
	// cipher_mode is "MODE-IVGEN[:IVHASH]" ("xts-plain64",
	// "cbc-essiv:sha256"); XTS splits the key in two, so its cipher is
	// named after half the key (qemu's qcrypto_block_luks_cipher_name).
	info.CipherMode, info.IvgenAlg, _ = strings.Cut(mode, "-")
	info.IvgenAlg, info.IvgenHashAlg, _ = strings.Cut(info.IvgenAlg, ":")
	bits := keyBytes * 8
	if info.CipherMode == "xts" {
		bits /= 2
	}
	info.CipherAlg = fmt.Sprintf("%s-%d", cipher, bits)
	for i := 0; i < luksSlots; i++ {
		s := b[208+i*luksSlotLen:]
		slot := LUKSSlot{KeyOffset: int64(binary.BigEndian.Uint32(s[40:])) * luksSectorSize}
		switch state := binary.BigEndian.Uint32(s); state {
		case luksSlotActive:
			slot.Active = true
			slot.Iters = ptr(binary.BigEndian.Uint32(s[4:]))
			slot.Stripes = ptr(binary.BigEndian.Uint32(s[44:]))
		case luksSlotInactive:
		default:
			return nil, &FormatError{File: name, Field: fmt.Sprintf("LUKS key slot %d state", i), Value: uint64(state), Offset: off + 208 + int64(i*luksSlotLen), Msg: "neither active nor inactive"}
		}
		info.Slots = append(info.Slots, slot)
	}
	return info, nil
}
