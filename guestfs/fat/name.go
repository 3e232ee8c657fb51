package fat

import (
	"unicode/utf8"
)

// Names as Linux's vfat shows them with its defaults: short (8.3) names
// through codepage 437 (CONFIG_FAT_DEFAULT_CODEPAGE), shortname=mixed
// (the lower-case flags of DIR_NTRes honoured, nothing else lowered),
// long names as UTF-8 (Debian's kernels set CONFIG_FAT_DEFAULT_UTF8; a
// kernel with iocharset=iso8859-1 would show non-Latin-1 characters as
// '?'), and lookups that ignore the case of ASCII letters only (Debian's
// iocharset=ascii; Linux's nls_strnicmp over it).

// cp437 is codepage 437's bytes 0x80-0xFF in Unicode (Linux's
// nls_cp437.c charset2uni); bytes below 0x80 are ASCII.
var cp437 = [128]rune{
	0xc7, 0xfc, 0xe9, 0xe2, 0xe4, 0xe0, 0xe5, 0xe7, 0xea, 0xeb, 0xe8, 0xef, 0xee, 0xec, 0xc4, 0xc5,
	0xc9, 0xe6, 0xc6, 0xf4, 0xf6, 0xf2, 0xfb, 0xf9, 0xff, 0xd6, 0xdc, 0xa2, 0xa3, 0xa5, 0x20a7, 0x192,
	0xe1, 0xed, 0xf3, 0xfa, 0xf1, 0xd1, 0xaa, 0xba, 0xbf, 0x2310, 0xac, 0xbd, 0xbc, 0xa1, 0xab, 0xbb,
	0x2591, 0x2592, 0x2593, 0x2502, 0x2524, 0x2561, 0x2562, 0x2556, 0x2555, 0x2563, 0x2551, 0x2557, 0x255d, 0x255c, 0x255b, 0x2510,
	0x2514, 0x2534, 0x252c, 0x251c, 0x2500, 0x253c, 0x255e, 0x255f, 0x255a, 0x2554, 0x2569, 0x2566, 0x2560, 0x2550, 0x256c, 0x2567,
	0x2568, 0x2564, 0x2565, 0x2559, 0x2558, 0x2552, 0x2553, 0x256b, 0x256a, 0x2518, 0x250c, 0x2588, 0x2584, 0x258c, 0x2590, 0x2580,
	0x3b1, 0xdf, 0x393, 0x3c0, 0x3a3, 0x3c3, 0xb5, 0x3c4, 0x3a6, 0x398, 0x3a9, 0x3b4, 0x221e, 0x3c6, 0x3b5, 0x2229,
	0x2261, 0xb1, 0x2265, 0x2264, 0x2320, 0x2321, 0xf7, 0x2248, 0xb0, 0x2219, 0xb7, 0x221a, 0x207f, 0xb2, 0x25a0, 0xa0,
}

// cp437Lower is codepage 437's lower-casing of bytes 0x80-0xFF that
// Linux's nls_cp437.c charset2lower changes (ASCII letters aside).
var cp437Lower = map[byte]byte{
	0x80: 0x87, 0x8e: 0x84, 0x8f: 0x86, 0x90: 0x82, 0x92: 0x91, 0x99: 0x94,
	0x9a: 0x81, 0xa5: 0xa4, 0xe4: 0xe5, 0xe8: 0xed,
}

func cp437Rune(c byte, lower bool) rune {
	if lower {
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		} else if l, ok := cp437Lower[c]; ok {
			c = l
		}
	}
	if c < 0x80 {
		return rune(c)
	}
	return cp437[c-0x80]
}

// DIR_NTRes bits: the base name or the extension is shown in lower case
// (Windows NT's way of keeping "readme.txt" without a long name).
const (
	caseLowerBase = 0x08
	caseLowerExt  = 0x10
)

// shortName is an 8.3 name as Linux's fat_parse_short shows it on vfat:
// trailing spaces of each part dropped (inner ones kept), the dot only
// before a non-empty extension, a NUL ending the name early, a first byte
// 0x05 standing for 0xE5; "" for a name of nothing but spaces.
func shortName(raw []byte, lcase byte) string {
	var w [11]byte
	copy(w[:], raw[:11])
	if w[0] == 0x05 {
		w[0] = 0xE5
	}
	var out []rune
	n := 0 // runes up to the last non-space
	for i := 0; i < 8 && w[i] != 0; i++ {
		out = append(out, cp437Rune(w[i], lcase&caseLowerBase != 0))
		if w[i] != ' ' {
			n = len(out)
		}
	}
	out = append(out[:n], '.')
	for i := 8; i < 11 && w[i] != 0; i++ {
		out = append(out, cp437Rune(w[i], lcase&caseLowerExt != 0))
		if w[i] != ' ' {
			n = len(out)
		}
	}
	return string(out[:n])
}

// utf16Name is a long name's UTF-16 as Linux's utf16s_to_utf8s turns it
// into UTF-8: up to the first NUL, a surrogate pair as one character, an
// unpaired surrogate dropped.
func utf16Name(u []uint16) string {
	b := make([]byte, 0, len(u))
	for i := 0; i < len(u) && u[i] != 0; i++ {
		c := rune(u[i])
		if c >= 0xD800 && c < 0xE000 {
			if c >= 0xDC00 || i+1 >= len(u) || u[i+1] < 0xDC00 || u[i+1] >= 0xE000 {
				continue // a lone low or high surrogate
			}
			i++
			c = 0x10000 + (c-0xD800)<<10 + (rune(u[i]) - 0xDC00)
		}
		b = utf8.AppendRune(b, c)
	}
	return string(b)
}

// checksum is the long-name checksum of an 8.3 name (LDIR_Chksum).
func checksum(raw []byte) byte {
	var s byte
	for _, c := range raw[:11] {
		s = (s&1)<<7 + s>>1 + c
	}
	return s
}
