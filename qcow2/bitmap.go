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
//
// The limits are qemu's (block/qcow2.h, block/qcow2-bitmap.c), and so is
// what breaks them: qemu refuses to open such an image, and so does this.
// They bound the memory: at most 65,535 bitmaps in a directory of at most
// 64 MiB, each table at most 512 MiB of bitmap (BME_MAX_PHYS_SIZE), so at
// most 8 MiB of table at 512-byte clusters. A table that several entries
// name is read once for the metadata map.

const (
	maxBitmaps         = 65535              // QCOW2_MAX_BITMAPS
	maxBitmapDirectory = 1024 * maxBitmaps  // QCOW2_MAX_BITMAP_DIRECTORY_SIZE
	maxBitmapTable     = 0x8000000          // BME_MAX_TABLE_SIZE, entries
	maxBitmapPhys      = 0x20000000         // BME_MAX_PHYS_SIZE, bytes of bitmap
	minBitmapGranBits  = 9                  // BME_MIN_GRANULARITY_BITS
	maxBitmapGranBits  = 31                 // BME_MAX_GRANULARITY_BITS
	maxBitmapName      = 1023               // BME_MAX_NAME_SIZE
	bitmapReservedFlag = 0xfffffffc         // BME_RESERVED_FLAGS
	bitmapInUse        = 1 << 0             // BME_FLAG_IN_USE
	bitmapAuto         = 1 << 1             // BME_FLAG_AUTO
	bitmapEntryMask    = 0x00fffffffffffe00 // BME_TABLE_ENTRY_OFFSET_MASK
	bitmapEntryRsvd    = 0xff000000000001fe // BME_TABLE_ENTRY_RESERVED_MASK
	bitmapDirEntry     = 24                 // fixed part of a directory entry
)

// bitmapEntry is one entry of the bitmap directory.
type bitmapEntry struct {
	tableOffset uint64
	tableSize   uint32 // entries
	flags       uint32
	typ         uint8
	granBits    uint8
	name        string
	off         int64 // of the entry, in the image file
}

// bitmapsUsed reports whether the image has bitmaps that qemu would use.
func (l *layer) bitmapsUsed() bool {
	h := l.hdr
	return h.HasBitmaps && h.AutoclearFeatures&AutoclearBitmaps != 0
}

// readBitmapDirectory reads and checks the bitmap directory, like qemu's
// bitmap_list_load and check_dir_entry. The directory's memory is charged
// while it is read.
func (l *layer) readBitmapDirectory() ([]bitmapEntry, error) {
	h := l.hdr
	ext := h.Bitmaps
	bad := func(field string, val uint64, off int64, format string, args ...any) error {
		return &FormatError{File: l.name, Field: field, Value: val, Offset: off, Msg: fmt.Sprintf(format, args...)}
	}
	cs := l.clusterSize()
	switch {
	case ext.NbBitmaps > maxBitmaps:
		return nil, bad("nb_bitmaps", uint64(ext.NbBitmaps), -1, "more than the %d bitmaps qemu supports", maxBitmaps)
	case ext.NbBitmaps == 0:
		return nil, bad("nb_bitmaps", 0, -1, "bitmaps extension with zero bitmaps")
	case ext.DirectoryOffset%uint64(cs) != 0:
		return nil, bad("bitmap_directory_offset", ext.DirectoryOffset, -1, "not aligned to the cluster size")
	case ext.DirectorySize == 0 || ext.DirectorySize > maxBitmapDirectory:
		return nil, bad("bitmap_directory_size", ext.DirectorySize, -1, "must be between 1 and %d", maxBitmapDirectory)
	case ext.DirectoryOffset >= uint64(l.fsize()) || ext.DirectorySize > uint64(l.fsize())-ext.DirectoryOffset:
		return nil, bad("bitmap_directory_offset", ext.DirectoryOffset, -1, "directory of %d bytes runs past the end of the file (%d bytes)", ext.DirectorySize, l.fsize())
	}
	if err := l.budget.add(int64(ext.DirectorySize), "bitmap directory"); err != nil {
		return nil, err
	}
	defer l.budget.sub(int64(ext.DirectorySize))
	dir := make([]byte, ext.DirectorySize)
	if err := l.meta.read(dir, int64(ext.DirectoryOffset), "bitmap directory"); err != nil {
		return nil, err
	}
	var out []bitmapEntry
	p := 0
	for p < len(dir) {
		at := int64(ext.DirectoryOffset) + int64(p)
		if p+bitmapDirEntry > len(dir) {
			return nil, bad("bitmap directory", uint64(p), at, "broken bitmap directory: entry %d runs past its end", len(out))
		}
		if len(out) == int(ext.NbBitmaps) {
			return nil, bad("bitmap directory", uint64(len(out)), at, "more bitmaps found than the header extension says (%d)", ext.NbBitmaps)
		}
		e := dir[p:]
		be := binary.BigEndian
		nameSize := int(be.Uint16(e[18:]))
		extraSize := int64(be.Uint32(e[20:]))
		size := (int64(bitmapDirEntry) + int64(nameSize) + extraSize + 7) &^ 7
		if int64(p)+size > int64(len(dir)) {
			return nil, bad("bitmap directory", uint64(p), at, "broken bitmap directory: entry %d runs past its end", len(out))
		}
		if extraSize != 0 {
			return nil, bad("bitmap extra_data_size", uint64(extraSize), at+20, "bitmap extra data is not supported")
		}
		b := bitmapEntry{
			tableOffset: be.Uint64(e),
			tableSize:   be.Uint32(e[8:]),
			flags:       be.Uint32(e[12:]),
			typ:         e[16],
			granBits:    e[17],
			name:        string(e[bitmapDirEntry : bitmapDirEntry+nameSize]),
			off:         at,
		}
		if err := l.checkBitmapEntry(&b); err != nil {
			return nil, err
		}
		out = append(out, b)
		p += int(size)
	}
	if len(out) != int(ext.NbBitmaps) {
		return nil, bad("nb_bitmaps", uint64(ext.NbBitmaps), -1, "the directory holds %d bitmaps, the header extension says %d", len(out), ext.NbBitmaps)
	}
	return out, nil
}

// checkBitmapEntry applies qemu's check_dir_entry.
func (l *layer) checkBitmapEntry(b *bitmapEntry) error {
	cs := uint64(l.clusterSize())
	phys := uint64(b.tableSize) * cs
	var why string
	switch {
	case b.tableSize == 0 || b.tableOffset == 0 || b.tableOffset%cs != 0:
		why = "its table is empty, at offset 0, or unaligned"
	case b.tableSize > maxBitmapTable || phys > maxBitmapPhys:
		why = fmt.Sprintf("its table of %d entries is larger than qemu allows", b.tableSize)
	case b.granBits < minBitmapGranBits || b.granBits > maxBitmapGranBits:
		why = fmt.Sprintf("granularity bits %d not between %d and %d", b.granBits, minBitmapGranBits, maxBitmapGranBits)
	case b.flags&bitmapReservedFlag != 0:
		why = fmt.Sprintf("reserved flags %#x set", b.flags)
	case len(b.name) > maxBitmapName:
		why = "name longer than 1023 bytes"
	case b.typ != 1:
		why = fmt.Sprintf("unknown type %d", b.typ)
	case b.flags&bitmapInUse == 0 && uint64(virtualSize(l.hdr.Size)) > (phys*8)<<b.granBits:
		why = "its table is too small for the disk"
	case b.tableOffset >= uint64(l.fsize()) || uint64(b.tableSize)*8 > uint64(l.fsize())-b.tableOffset:
		why = "its table runs past the end of the file"
	default:
		return nil
	}
	return &FormatError{File: l.name, Field: "bitmap directory entry", Value: b.tableOffset, Offset: b.off,
		Msg: fmt.Sprintf("bitmap %q does not satisfy the constraints: %s", b.name, why)}
}

// readBitmapTable reads the table of b, checking its entries like qemu's
// bitmap_table_load. Its memory is charged; the caller gives it back.
func (l *layer) readBitmapTable(b *bitmapEntry) ([]uint64, error) {
	t, err := l.readTransient(int64(b.tableOffset), int64(b.tableSize), fmt.Sprintf("bitmap table of %q", b.name))
	if err != nil {
		return nil, err
	}
	cs := uint64(l.clusterSize())
	for i, e := range t {
		off := e & bitmapEntryMask
		if e&bitmapEntryRsvd != 0 || off != 0 && (e&1 != 0 || off%cs != 0) {
			l.budget.sub(int64(len(t)) * 8)
			return nil, &FormatError{File: l.name, Field: "bitmap table entry", Value: e, Offset: int64(b.tableOffset) + 8*int64(i),
				Msg: fmt.Sprintf("bitmap %q: reserved bits set or data cluster unaligned", b.name)}
		}
	}
	return t, nil
}

// addBitmaps calls add with the bitmap directory, every bitmap table and
// the data clusters the tables name, with how many times each is named:
// once for the directory, and for a table and its data clusters the
// number of directory entries that name the table (or 1 with once: the
// metadata map). Each distinct table is read once, and the tables read
// together must not exceed maxMapTableBytes.
func (l *layer) addBitmaps(add func(start, length int64, kind MetaKind, times int64), once bool) error {
	if !l.bitmapsUsed() {
		return nil
	}
	dir, err := l.readBitmapDirectory()
	if err != nil {
		return err
	}
	h := l.hdr
	cs := l.clusterSize()
	add(int64(h.Bitmaps.DirectoryOffset), int64(h.Bitmaps.DirectorySize), MetaBitmapDirectory, 1)
	type table struct {
		b     *bitmapEntry
		times int64
	}
	var tables []*table
	byKey := map[[2]uint64]*table{}
	for i := range dir {
		b := &dir[i]
		key := [2]uint64{b.tableOffset, uint64(b.tableSize)}
		if t := byKey[key]; t != nil {
			t.times++
			continue
		}
		t := &table{b: b, times: 1}
		byKey[key] = t
		tables = append(tables, t)
	}
	var read int64
	for _, tb := range tables {
		b := tb.b
		if read += int64(b.tableSize) * 8; read > maxMapTableBytes {
			return &FormatError{File: l.name, Field: "bitmap directory", Value: uint64(read), Offset: b.off,
				Msg: fmt.Sprintf("the bitmap tables hold more than %d bytes", maxMapTableBytes)}
		}
		t, err := l.readBitmapTable(b)
		if err != nil {
			return err
		}
		if !once {
			// Every reference, as often as the table is named
			// (a cluster the table names twice counts twice).
			add(int64(b.tableOffset), int64(b.tableSize)*8, MetaBitmapTable, tb.times)
			for _, e := range t {
				if o := int64(e & bitmapEntryMask); o != 0 {
					add(o, cs, MetaBitmapData, tb.times)
				}
			}
			l.budget.sub(int64(len(t)) * 8)
			continue
		}
		// For the map: once, whoever names the table (the map's
		// builder merges as it goes).
		add(int64(b.tableOffset), int64(b.tableSize)*8, MetaBitmapTable, 1)
		for _, e := range t {
			if o := int64(e & bitmapEntryMask); o != 0 {
				add(o, cs, MetaBitmapData, 1)
			}
		}
		l.budget.sub(int64(len(t)) * 8)
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
	if !l.bitmapsUsed() {
		return nil
	}
	dir, err := l.readBitmapDirectory()
	if err != nil {
		return nil
	}
	var out []Bitmap
	for _, e := range dir {
		b := Bitmap{Name: e.name, Granularity: 1 << e.granBits, Flags: []string{}}
		if e.flags&bitmapInUse != 0 {
			b.Flags = append(b.Flags, "in-use")
		}
		if e.flags&bitmapAuto != 0 {
			b.Flags = append(b.Flags, "auto")
		}
		out = append(out, b)
	}
	return out
}
