package fat

import (
	"encoding/binary"
	"strings"
)

// A directory is an array of 32-byte entries: short (8.3) entries, each
// the record of one file, and before one the long-name slots that spell
// its long name, last slot first.
const direntLen = 32

// DIR_Attr bits.
const (
	attrReadOnly = 0x01
	attrVolumeID = 0x08
	attrDir      = 0x10
	attrLongName = 0x0F // a long-name slot
)

const (
	deletedFlag = 0xE5 // DIR_Name[0] of a deleted entry
	lastSlot    = 0x40 // LDIR_Ord bit of the long name's last slot (stored first)
	maxSlots    = 20   // ceil(255 * 2 / 26): Linux's limit
)

// dirent is one file of a directory: its short entry's fields (named as
// in the specification) and its names as Linux shows them.
type dirent struct {
	index   int    // the short entry's index in the directory
	short   string // the short name as shown; "" if only spaces
	long    string // the long name, if hasLong
	hasLong bool   // a long name whose checksum matches the short entry

	Attr         byte
	NTRes        byte // lower-case flags
	CrtTimeTenth byte // centiseconds (0-199) past CrtTime
	CrtTime      uint16
	CrtDate      uint16
	LstAccDate   uint16
	WrtTime      uint16
	WrtDate      uint16
	FstClus      uint32 // FstClusHI (FAT32 only) << 16 | FstClusLO
	FileSize     uint32
}

// name is what a listing shows: the long name if there is one.
func (d *dirent) name() string {
	if d.hasLong {
		return d.long
	}
	return d.short
}

// badName says why a name is one that Linux's getdents refuses to hand
// out (it fails the listing with EUCLEAN there), or that io/fs cannot
// name: empty, with a '/', "." or "..". "" if the name is good.
func badName(n string) string {
	switch {
	case n == "":
		return "empty"
	case strings.ContainsRune(n, '/'):
		return "holds a '/'"
	case n == "." || n == "..":
		return "is " + n
	}
	return ""
}

func (d *dirent) isDir() bool { return d.Attr&attrDir != 0 }

func direntOf(de []byte, index int, fat32 bool) dirent {
	le := binary.LittleEndian
	d := dirent{
		index:        index,
		short:        shortName(de, de[12]),
		Attr:         de[11],
		NTRes:        de[12],
		CrtTimeTenth: de[13],
		CrtTime:      le.Uint16(de[14:]),
		CrtDate:      le.Uint16(de[16:]),
		LstAccDate:   le.Uint16(de[18:]),
		WrtTime:      le.Uint16(de[22:]),
		WrtDate:      le.Uint16(de[24:]),
		FstClus:      uint32(le.Uint16(de[26:])),
		FileSize:     le.Uint32(de[28:]),
	}
	if fat32 {
		d.FstClus |= uint32(le.Uint16(de[20:])) << 16
	}
	return d
}

// parsedDir is what parseDir makes of a directory's bytes.
type parsedDir struct {
	entries []dirent // the files, in directory order, dot entries left out
	// dotdot is the first cluster the ".." entry names, -1 without one;
	// subdirs counts the short entries with the directory bit, dot
	// entries included (Linux's fat_subdirs, whence a directory's
	// nlink); label is the first volume label entry's name.
	dotdot  int64
	subdirs int
	label   string
}

var (
	dotName    = ".          "
	dotdotName = "..         "
)

// isFree is Linux's IS_FREE: a deleted entry or a free one.
func isFree(de []byte) bool { return de[0] == deletedFlag || de[0] == 0 }

// parseDir reads the entries of b (a whole directory) as Linux's
// __fat_readdir does on vfat, record by record: deleted, free and volume
// label entries skipped (a free entry does not end a directory for
// Linux), long names gathered by fat_parse_long's rules (slots counted
// down under one checksum; a long name whose checksum does not match its
// short entry dropped, the short name shown), the dot entries set aside.
// fat32 says whether DIR_FstClusHI counts.
func parseDir(b []byte, fat32 bool) *parsedDir {
	pd := &parsedDir{dotdot: -1}
	n := len(b) / direntLen
	entry := func(i int) []byte { return b[i*direntLen : (i+1)*direntLen] }
	// fat_subdirs, fat_get_dotdot_entry and the label: short entries
	// by fat_get_short_entry's rule.
	for i := 0; i < n; i++ {
		de := entry(i)
		switch {
		case isFree(de):
		case de[11]&attrVolumeID != 0:
			if de[11] != attrLongName && pd.label == "" {
				var r []rune
				for _, c := range de[:11] {
					r = append(r, cp437Rune(c, false))
				}
				pd.label = strings.TrimRight(string(r), " ")
			}
		case de[11]&attrDir != 0:
			pd.subdirs++
			if string(de[:11]) == dotdotName && pd.dotdot < 0 {
				pd.dotdot = int64(direntOf(de, i, fat32).FstClus)
			}
		}
	}
	var uni [maxSlots * 13]uint16
	for pos := 0; pos < n; {
		de := entry(pos)
		pos++
	record:
		if de[0] == deletedFlag || de[11] != attrLongName && (de[11]&attrVolumeID != 0 || de[0] == 0) {
			continue
		}
		long, hasLong := "", false
		if de[11] == attrLongName {
			var status int
			var sum byte
			de, pos, sum, status = parseLong(entry, n, pos, de, &uni)
			switch status {
			case parseInvalid:
				continue
			case parseNotLong:
				goto record
			case parseEOF:
				return pd
			}
			if checksum(de) == sum {
				long, hasLong = utf16Name(uni[:]), true
			}
		}
		d := direntOf(de, pos-1, fat32)
		if !hasLong && d.short == "" || string(de[:11]) == dotName || string(de[:11]) == dotdotName {
			continue
		}
		d.long, d.hasLong = long, hasLong
		pd.entries = append(pd.entries, d)
	}
	return pd
}

const (
	parseOK = iota
	parseInvalid
	parseNotLong
	parseEOF
)

// parseLong is Linux's fat_parse_long: de, the entry before pos, is a
// long-name slot. It gathers the slots into uni and returns the entry it
// ended on (the short entry, on parseOK), the position after it, and the
// checksum the slots were read under.
func parseLong(entry func(int) []byte, n, pos int, de []byte, uni *[maxSlots * 13]uint16) ([]byte, int, byte, int) {
	le := binary.LittleEndian
restart:
	id := de[0]
	if id&lastSlot == 0 {
		return de, pos, 0, parseInvalid
	}
	slots := int(id &^ lastSlot)
	if slots > maxSlots || slots == 0 {
		return de, pos, 0, parseInvalid
	}
	sum := de[13]
	for slot := slots - 1; ; slot-- {
		u := uni[slot*13:]
		for k := 0; k < 5; k++ {
			u[k] = le.Uint16(de[1+2*k:])
		}
		for k := 0; k < 6; k++ {
			u[5+k] = le.Uint16(de[14+2*k:])
		}
		for k := 0; k < 2; k++ {
			u[11+k] = le.Uint16(de[28+2*k:])
		}
		if de[0]&lastSlot != 0 && slot*13+13 < maxSlots*13 {
			uni[slot*13+13] = 0
		}
		if pos >= n {
			return de, pos, sum, parseEOF
		}
		de = entry(pos)
		pos++
		if slot == 0 {
			break
		}
		if de[11] != attrLongName {
			return de, pos, sum, parseNotLong
		}
		if int(de[0]&^lastSlot) != slot || de[13] != sum {
			goto restart
		}
	}
	switch {
	case de[0] == deletedFlag:
		return de, pos, sum, parseInvalid
	case de[11] == attrLongName:
		goto restart
	case isFree(de) || de[11]&attrVolumeID != 0:
		return de, pos, sum, parseInvalid
	}
	return de, pos, sum, parseOK
}
