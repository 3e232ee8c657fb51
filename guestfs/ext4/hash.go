package ext4

import "math/bits"

// Directory hash versions (dx_root_info.hash_version; directory.rst,
// "dirhash"). The unsigned variants are what the signed ones become on a
// file system whose s_flags say names were hashed with unsigned chars.
const (
	hashLegacy = iota
	hashHalfMD4
	hashTea
	hashLegacyUnsigned
	hashHalfMD4Unsigned
	hashTeaUnsigned
	hashSiphash
)

// dxHash computes the htree hash of name (ext4fs_dirhash in the kernel's
// fs/ext4/hash.c, which this follows; e2fsprogs' ext2fs_dirhash is the
// same): the major hash with its lowest bit clear, and the minor hash.
// seed is s_hash_seed; all zeros means the MD4 initial state.
func dxHash(name []byte, version int, seed [4]uint32) (hash, minor uint32) {
	buf := [4]uint32{0x67452301, 0xefcdab89, 0x98badcfe, 0x10325476}
	if seed != [4]uint32{} {
		buf = seed
	}
	signed := version < hashLegacyUnsigned
	switch version {
	case hashLegacy, hashLegacyUnsigned:
		hash = legacyHash(name, signed)
	case hashHalfMD4, hashHalfMD4Unsigned:
		var in [8]uint32
		for p := name; len(p) > 0; p = p[32:] {
			str2hashbuf(p, in[:], signed)
			halfMD4(&buf, &in)
			if len(p) <= 32 {
				break
			}
		}
		hash, minor = buf[1], buf[2]
	case hashTea, hashTeaUnsigned:
		var in [4]uint32
		for p := name; len(p) > 0; p = p[16:] {
			str2hashbuf(p, in[:], signed)
			tea(&buf, &in)
			if len(p) <= 16 {
				break
			}
		}
		hash, minor = buf[0], buf[1]
	}
	hash &^= 1
	if hash == 0x7fffffff<<1 { // EXT4_HTREE_EOF_32BIT << 1 is reserved
		hash = (0x7fffffff - 1) << 1
	}
	return hash, minor
}

// char is a name byte as C's char saw it: signed or not.
func char(c byte, signed bool) uint32 {
	if signed {
		return uint32(int32(int8(c)))
	}
	return uint32(c)
}

// legacyHash is dx_hack_hash.
func legacyHash(name []byte, signed bool) uint32 {
	h0, h1 := uint32(0x12a3fe2d), uint32(0x37abe8f9)
	for _, c := range name {
		h := h1 + (h0 ^ char(c, signed)*7152373)
		if h&0x80000000 != 0 {
			h -= 0x7fffffff
		}
		h1, h0 = h0, h
	}
	return h0 << 1
}

// str2hashbuf packs up to 4*len(buf) bytes of msg into buf, big-end
// first, padding with a word made of the length (of all of msg).
func str2hashbuf(msg []byte, buf []uint32, signed bool) {
	n := uint32(len(msg))
	pad := n | n<<8
	pad |= pad << 16
	msg = msg[:min(len(msg), 4*len(buf))]
	val := pad
	i := 0
	for j, c := range msg {
		if j%4 == 0 {
			val = pad
		}
		val = char(c, signed) + val<<8
		if j%4 == 3 {
			buf[i] = val
			i++
			val = pad
		}
	}
	if i < len(buf) {
		buf[i] = val
		i++
	}
	for ; i < len(buf); i++ {
		buf[i] = pad
	}
}

// halfMD4 is the kernel's half_md4_transform: MD4's three rounds over
// eight words instead of sixteen.
func halfMD4(buf *[4]uint32, in *[8]uint32) {
	const k2, k3 = 0x5A827999, 0x6ED9EBA1
	f := func(x, y, z uint32) uint32 { return z ^ (x & (y ^ z)) }
	g := func(x, y, z uint32) uint32 { return (x & y) + ((x ^ y) & z) }
	h := func(x, y, z uint32) uint32 { return x ^ y ^ z }
	a, b, c, d := buf[0], buf[1], buf[2], buf[3]
	step := func(fn func(x, y, z uint32) uint32, a *uint32, b, c, d, x uint32, s int) {
		*a = bits.RotateLeft32(*a+fn(b, c, d)+x, s)
	}
	step(f, &a, b, c, d, in[0], 3)
	step(f, &d, a, b, c, in[1], 7)
	step(f, &c, d, a, b, in[2], 11)
	step(f, &b, c, d, a, in[3], 19)
	step(f, &a, b, c, d, in[4], 3)
	step(f, &d, a, b, c, in[5], 7)
	step(f, &c, d, a, b, in[6], 11)
	step(f, &b, c, d, a, in[7], 19)

	step(g, &a, b, c, d, in[1]+k2, 3)
	step(g, &d, a, b, c, in[3]+k2, 5)
	step(g, &c, d, a, b, in[5]+k2, 9)
	step(g, &b, c, d, a, in[7]+k2, 13)
	step(g, &a, b, c, d, in[0]+k2, 3)
	step(g, &d, a, b, c, in[2]+k2, 5)
	step(g, &c, d, a, b, in[4]+k2, 9)
	step(g, &b, c, d, a, in[6]+k2, 13)

	step(h, &a, b, c, d, in[3]+k3, 3)
	step(h, &d, a, b, c, in[7]+k3, 9)
	step(h, &c, d, a, b, in[2]+k3, 11)
	step(h, &b, c, d, a, in[6]+k3, 15)
	step(h, &a, b, c, d, in[1]+k3, 3)
	step(h, &d, a, b, c, in[5]+k3, 9)
	step(h, &c, d, a, b, in[0]+k3, 11)
	step(h, &b, c, d, a, in[4]+k3, 15)

	buf[0] += a
	buf[1] += b
	buf[2] += c
	buf[3] += d
}

// tea is TEA_transform: 16 rounds of the Tiny Encryption Algorithm.
func tea(buf *[4]uint32, in *[4]uint32) {
	const delta = 0x9E3779B9
	var sum uint32
	b0, b1 := buf[0], buf[1]
	a, b, c, d := in[0], in[1], in[2], in[3]
	for range 16 {
		sum += delta
		b0 += ((b1 << 4) + a) ^ (b1 + sum) ^ ((b1 >> 5) + b)
		b1 += ((b0 << 4) + c) ^ (b0 + sum) ^ ((b0 >> 5) + d)
	}
	buf[0] += b0
	buf[1] += b1
}
