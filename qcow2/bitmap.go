package qcow2

import (
	"encoding/binary"
	"fmt"
)

// Persistent dirty bitmaps (specification, "Bitmaps extension"). qcowfs
// does not use their content; it only needs to know which clusters they
// occupy, for the metadata map and the image check. qemu uses them only
// while autoclear bit 0 says they are consistent, and so does this.
//
// The directory (bitmap_directory_offset, bitmap_directory_size) holds one
// entry per bitmap, padded to 8 bytes: bitmap_table_offset (u64),
// bitmap_table_size (u32, entries), flags (u32), type (u8),
// granularity_bits (u8), name_size (u16), extra_data_size (u32), then the
// extra data and the name. A bitmap table entry's bits 9-55 are the offset
// of a cluster of bitmap data (0: all zeros, or all ones with bit 0).

const (
	maxBitmapDirectory = 64 << 20  // qemu's QCOW2_MAX_BITMAP_DIRECTORY_SIZE
	maxBitmapTable     = 0x4000000 // qemu's BME_MAX_TABLE_SIZE, entries
	bitmapEntryMask    = 0x00fffffffffffe00
)

// addBitmaps adds the bitmap directory, every bitmap table and the data
// clusters the tables name to b, checking each against the file.
func (l *layer) addBitmaps(b *metaBuilder) error {
	h := l.hdr
	if !h.HasBitmaps || h.AutoclearFeatures&AutoclearBitmaps == 0 || h.Bitmaps.NbBitmaps == 0 {
		return nil
	}
	bad := func(field string, val uint64, format string, args ...any) error {
		return &FormatError{File: l.name, Field: field, Value: val, Offset: -1, Msg: fmt.Sprintf(format, args...)}
	}
	cs := l.clusterSize()
	dirOff, dirSize := h.Bitmaps.DirectoryOffset, h.Bitmaps.DirectorySize
	if dirSize > maxBitmapDirectory || dirOff%uint64(cs) != 0 || dirOff >= uint64(l.fsize()) || dirSize > uint64(l.fsize())-dirOff {
		return bad("bitmap_directory_offset", dirOff, "directory of %d bytes is unaligned, too large or past the end of the file", dirSize)
	}
	dir := make([]byte, dirSize)
	if err := l.meta.read(dir, int64(dirOff), "bitmap directory"); err != nil {
		return err
	}
	b.add(int64(dirOff), int64(dirSize), MetaBitmapDirectory)
	for i, p := uint32(0), 0; i < h.Bitmaps.NbBitmaps; i++ {
		if p+24 > len(dir) {
			return bad("bitmap directory entry", uint64(i), "bitmap %d runs past the directory", i)
		}
		e := dir[p:]
		tOff := binary.BigEndian.Uint64(e)
		tSize := uint64(binary.BigEndian.Uint32(e[8:]))
		nameSize := int(binary.BigEndian.Uint16(e[18:]))
		extraSize := int(binary.BigEndian.Uint32(e[20:]))
		p += (24 + extraSize + nameSize + 7) &^ 7
		if tSize > maxBitmapTable || tOff%uint64(cs) != 0 || tOff >= uint64(l.fsize()) || tSize*8 > uint64(l.fsize())-tOff {
			return bad("bitmap_table_offset", tOff, "bitmap %d: table of %d entries is unaligned, too large or past the end of the file", i, tSize)
		}
		table, err := l.meta.words(int64(tOff), int64(tSize), fmt.Sprintf("bitmap table %d", i))
		if err != nil {
			return err
		}
		b.add(int64(tOff), int64(tSize)*8, MetaBitmapTable)
		for _, e := range table {
			if o := int64(e & bitmapEntryMask); o != 0 {
				b.add(o, cs, MetaBitmapData)
			}
		}
	}
	return nil
}

// Bitmap is one persistent bitmap, as qemu-img info lists it.
type Bitmap struct {
	Flags       []string `json:"flags"`
	Name        string   `json:"name"`
	Granularity int64    `json:"granularity"`
}

// Bitmaps lists the image's persistent bitmaps (nil if it has none, or
// if the directory cannot be read).
func (img *Image) Bitmaps() []Bitmap {
	l := img.top
	h := l.hdr
	if !h.HasBitmaps || h.AutoclearFeatures&AutoclearBitmaps == 0 || h.Bitmaps.NbBitmaps == 0 ||
		h.Bitmaps.DirectorySize > maxBitmapDirectory ||
		h.Bitmaps.DirectoryOffset >= uint64(l.fsize()) || h.Bitmaps.DirectorySize > uint64(l.fsize())-h.Bitmaps.DirectoryOffset {
		return nil
	}
	dir := make([]byte, h.Bitmaps.DirectorySize)
	if err := l.meta.read(dir, int64(h.Bitmaps.DirectoryOffset), "bitmap directory"); err != nil {
		return nil
	}
	var out []Bitmap
	for i, p := uint32(0), 0; i < h.Bitmaps.NbBitmaps && p+24 <= len(dir); i++ {
		e := dir[p:]
		flags := binary.BigEndian.Uint32(e[12:])
		gran := e[17]
		nameSize := int(binary.BigEndian.Uint16(e[18:]))
		extraSize := int(binary.BigEndian.Uint32(e[20:]))
		if p+24+extraSize+nameSize > len(dir) || gran > 63 {
			break
		}
		b := Bitmap{Name: string(e[24+extraSize : 24+extraSize+nameSize]), Granularity: 1 << gran, Flags: []string{}}
		if flags&1 != 0 {
			b.Flags = append(b.Flags, "in-use")
		}
		if flags&2 != 0 {
			b.Flags = append(b.Flags, "auto")
		}
		out = append(out, b)
		p += (24 + extraSize + nameSize + 7) &^ 7
	}
	return out
}
