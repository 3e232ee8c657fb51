package qcow2

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"strings"
)

// Magic is the first four bytes of every qcow2 image: "QFI\xfb".
const Magic = 0x514649fb

// Limits qemu enforces (block/qcow2.h); an image beyond them is refused.
const (
	minClusterBits = 9  // 512 B
	maxClusterBits = 21 // 2 MiB
	// maxL1Bytes is QCOW_MAX_L1_SIZE: qemu refuses larger L1 tables.
	maxL1Bytes = 32 << 20
	// maxSnapshots is QCOW_MAX_SNAPSHOTS.
	maxSnapshots = 65536
	// maxBackingNameLen is the longest backing file name qemu accepts.
	maxBackingNameLen = 1023
	// maxRefcountOrder: refcounts are at most 64 bits wide.
	maxRefcountOrder = 6
	v2HeaderLen      = 72
	v3HeaderLen      = 104
)

// Incompatible feature bits (specification, "incompatible_features").
const (
	IncompatDirty           = 1 << 0
	IncompatCorrupt         = 1 << 1
	IncompatExternalData    = 1 << 2
	IncompatCompressionType = 1 << 3
	IncompatExtendedL2      = 1 << 4
	incompatKnown           = IncompatDirty | IncompatCorrupt | IncompatExternalData |
		IncompatCompressionType | IncompatExtendedL2
)

// Compatible and autoclear feature bits.
const (
	CompatLazyRefcounts    = 1 << 0
	AutoclearBitmaps       = 1 << 0
	AutoclearDataFileRaw   = 1 << 1
	compressionDeflate     = 0
	compressionZstd        = 1
	cryptNone              = 0
	cryptAES               = 1
	cryptLUKS              = 2
	extEnd                 = 0x00000000
	extBackingFormat       = 0xe2792aca
	extFeatureTable        = 0x6803f857
	extBitmaps             = 0x23852875
	extCryptoHeader        = 0x0537be77
	extDataFile            = 0x44415441
	featureTableEntryBytes = 48
)

// Header is the qcow2 header (specification, "Header"), with the header
// extensions that matter for reading. Field names follow the specification.
type Header struct {
	Version               uint32
	BackingFileOffset     uint64
	BackingFileSize       uint32
	ClusterBits           uint32
	Size                  uint64 // virtual disk size in bytes
	CryptMethod           uint32
	L1Size                uint32 // number of L1 entries
	L1TableOffset         uint64
	RefcountTableOffset   uint64
	RefcountTableClusters uint32
	NbSnapshots           uint32
	SnapshotsOffset       uint64

	// Version 3 fields; for version 2 they hold the implied values.
	IncompatibleFeatures uint64
	CompatibleFeatures   uint64
	AutoclearFeatures    uint64
	RefcountOrder        uint32
	HeaderLength         uint32
	CompressionType      uint8

	// From the header extensions and the backing file name area.
	BackingFile       string // empty: no backing file
	BackingFormat     string // from extension 0xe2792aca; empty if absent
	DataFile          string // from extension 0x44415441; empty if absent
	HasBitmaps        bool   // extension 0x23852875 present
	Bitmaps           BitmapsExtension
	FeatureNames      []FeatureName
	CryptoHeaderFound bool
}

// BitmapsExtension is the bitmaps header extension (0x23852875).
type BitmapsExtension struct {
	NbBitmaps       uint32
	DirectorySize   uint64
	DirectoryOffset uint64
}

// A FeatureName is one entry of the feature name table extension.
type FeatureName struct {
	Type uint8 // 0 incompatible, 1 compatible, 2 autoclear
	Bit  uint8
	Name string
}

// ClusterSize is the cluster size in bytes.
func (h *Header) ClusterSize() int64 { return 1 << h.ClusterBits }

// ExtendedL2 reports whether L2 entries are 128 bits with subclusters.
func (h *Header) ExtendedL2() bool { return h.IncompatibleFeatures&IncompatExtendedL2 != 0 }

// CompressionName is the compression type as qemu names it.
func (h *Header) CompressionName() string {
	if h.CompressionType == compressionZstd {
		return "zstd"
	}
	return "zlib"
}

// featureName returns the image's own name for a feature bit, falling back
// to the names qemu defines, then to "bit N".
func (h *Header) featureName(typ, bit uint8) string {
	for _, f := range h.FeatureNames {
		if f.Type == typ && f.Bit == bit && f.Name != "" {
			return f.Name
		}
	}
	if typ == 0 {
		switch bit {
		case 0:
			return "dirty bit"
		case 1:
			return "corrupt bit"
		case 2:
			return "external data file"
		case 3:
			return "compression type"
		case 4:
			return "extended L2 entries"
		}
	}
	return fmt.Sprintf("bit %d", bit)
}

// headerReader parses and validates the header of one file. Each field is
// checked where it is read; errors name the file, field, value and offset.
type headerReader struct {
	ra       io.ReaderAt
	file     string
	fileSize int64
	buf      []byte // the first cluster (or the whole file if shorter)
}

func (r *headerReader) bad(field string, val uint64, off int64, format string, args ...any) error {
	return &FormatError{File: r.file, Field: field, Value: val, Offset: off, Msg: fmt.Sprintf(format, args...)}
}

// read fills r.buf with the first n bytes of the file (fewer if it is
// shorter).
func (r *headerReader) read(n int64) error {
	if r.fileSize < n {
		n = r.fileSize
	}
	r.buf = make([]byte, n)
	got, err := r.ra.ReadAt(r.buf, 0)
	if err != nil && err != io.EOF {
		return fmt.Errorf("%s: reading header: %w", r.file, err)
	}
	r.buf = r.buf[:got]
	return nil
}

func (r *headerReader) u32(off int) uint32 { return binary.BigEndian.Uint32(r.buf[off:]) }
func (r *headerReader) u64(off int) uint64 { return binary.BigEndian.Uint64(r.buf[off:]) }

// readHeader reads and validates the header of the image in ra, a file of
// fileSize bytes named name (for messages).
func readHeader(ra io.ReaderAt, name string, fileSize int64) (*Header, error) {
	r := &headerReader{ra: ra, file: name, fileSize: fileSize}
	// The header, its extensions and the backing file name all live in
	// the first cluster: read 4 KiB, then the rest of the cluster once
	// cluster_bits is known.
	if err := r.read(4096); err != nil {
		return nil, err
	}
	if len(r.buf) < 4 || binary.BigEndian.Uint32(r.buf) != Magic {
		return nil, fmt.Errorf("%s: %w", name, ErrNotQcow2)
	}
	if len(r.buf) >= v2HeaderLen {
		if bits := r.u32(20); bits >= minClusterBits && bits <= maxClusterBits && 1<<bits > len(r.buf) {
			if err := r.read(1 << bits); err != nil {
				return nil, err
			}
		}
	}
	if len(r.buf) < v2HeaderLen {
		return nil, r.bad("header", uint64(len(r.buf)), 0, "file is %d bytes, shorter than a version 2 header (%d)", len(r.buf), v2HeaderLen)
	}
	return r.parse()
}

func (r *headerReader) parse() (*Header, error) {
	h := &Header{
		Version:               r.u32(4),
		BackingFileOffset:     r.u64(8),
		BackingFileSize:       r.u32(16),
		ClusterBits:           r.u32(20),
		Size:                  r.u64(24),
		CryptMethod:           r.u32(32),
		L1Size:                r.u32(36),
		L1TableOffset:         r.u64(40),
		RefcountTableOffset:   r.u64(48),
		RefcountTableClusters: r.u32(56),
		NbSnapshots:           r.u32(60),
		SnapshotsOffset:       r.u64(64),
		RefcountOrder:         4,
		HeaderLength:          v2HeaderLen,
	}
	if h.Version != 2 && h.Version != 3 {
		return nil, &UnsupportedError{File: r.file, Feature: fmt.Sprintf("qcow2 version %d", h.Version)}
	}
	if h.ClusterBits < minClusterBits || h.ClusterBits > maxClusterBits {
		return nil, r.bad("cluster_bits", uint64(h.ClusterBits), 20, "must be between %d and %d", minClusterBits, maxClusterBits)
	}
	clusterSize := h.ClusterSize()

	if h.Version == 3 {
		if len(r.buf) < v3HeaderLen {
			return nil, r.bad("header_length", uint64(len(r.buf)), 100, "file too short for a version 3 header")
		}
		h.IncompatibleFeatures = r.u64(72)
		h.CompatibleFeatures = r.u64(80)
		h.AutoclearFeatures = r.u64(88)
		h.RefcountOrder = r.u32(96)
		h.HeaderLength = r.u32(100)
		if h.HeaderLength < v3HeaderLen || h.HeaderLength%8 != 0 || int64(h.HeaderLength) > clusterSize {
			return nil, r.bad("header_length", uint64(h.HeaderLength), 100, "must be at least %d, a multiple of 8 and at most the cluster size", v3HeaderLen)
		}
		if int(h.HeaderLength) > len(r.buf) {
			return nil, r.bad("header_length", uint64(h.HeaderLength), 100, "runs past the end of the file (%d bytes)", r.fileSize)
		}
		if h.RefcountOrder > maxRefcountOrder {
			return nil, r.bad("refcount_order", uint64(h.RefcountOrder), 96, "must be at most %d", maxRefcountOrder)
		}
		if h.HeaderLength > v3HeaderLen {
			h.CompressionType = r.buf[104]
		}
	}

	// Header extensions come before anything else is validated, so that
	// errors about unknown features can use the image's own names.
	if err := r.parseExtensions(h); err != nil {
		return nil, err
	}

	if unknown := h.IncompatibleFeatures &^ incompatKnown; unknown != 0 {
		var names []string
		for bit := 0; bit < 64; bit++ {
			if unknown&(1<<bit) != 0 {
				names = append(names, h.featureName(0, uint8(bit)))
			}
		}
		return nil, &UnsupportedError{File: r.file, Feature: "unknown incompatible feature " + strings.Join(names, ", ")}
	}
	hasCompressionBit := h.IncompatibleFeatures&IncompatCompressionType != 0
	switch {
	case h.CompressionType > compressionZstd:
		return nil, r.bad("compression_type", uint64(h.CompressionType), 104, "unknown compression type")
	case (h.CompressionType != compressionDeflate) != hasCompressionBit:
		return nil, r.bad("compression_type", uint64(h.CompressionType), 104, "must be non-zero exactly when incompatible bit 3 is set (incompatible_features %#x)", h.IncompatibleFeatures)
	}
	if h.ExtendedL2() && h.ClusterBits < 14 {
		return nil, r.bad("cluster_bits", uint64(h.ClusterBits), 20, "extended L2 entries need clusters of at least 16 KiB")
	}
	if h.IncompatibleFeatures&IncompatExternalData != 0 && h.DataFile == "" {
		return nil, r.bad("incompatible_features", h.IncompatibleFeatures, 72, "external data file bit set but no data file name extension")
	}
	if h.IncompatibleFeatures&IncompatExternalData == 0 && h.AutoclearFeatures&AutoclearDataFileRaw != 0 {
		// qemu clears this autoclear bit when there is no data file;
		// it carries no meaning here.
		h.AutoclearFeatures &^= AutoclearDataFileRaw
	}

	switch h.CryptMethod {
	case cryptNone:
	case cryptAES:
		return nil, &UnsupportedError{File: r.file, Feature: "encrypted (aes)"}
	case cryptLUKS:
		return nil, &UnsupportedError{File: r.file, Feature: "encrypted (luks)"}
	default:
		return nil, r.bad("crypt_method", uint64(h.CryptMethod), 32, "unknown encryption method")
	}

	if err := r.checkTables(h); err != nil {
		return nil, err
	}
	if err := r.readBackingName(h); err != nil {
		return nil, err
	}
	return h, nil
}

// checkTables validates the L1, refcount and snapshot table locations
// against the specification and the file size.
func (r *headerReader) checkTables(h *Header) error {
	cs := uint64(h.ClusterSize())
	entryBytes := uint64(8)
	if h.ExtendedL2() {
		entryBytes = 16
	}
	l2Entries := cs / entryBytes
	// Bytes of guest disk covered by one L1 entry.
	l1Span := l2Entries * cs

	if h.Size > 1<<62 {
		return r.bad("size", h.Size, 24, "virtual size too large")
	}
	needL1 := (h.Size + l1Span - 1) / l1Span
	if needL1 > maxL1Bytes/8 {
		return r.bad("size", h.Size, 24, "image too big: it needs %d L1 entries, more than the %d qemu allows", needL1, maxL1Bytes/8)
	}
	if uint64(h.L1Size) < needL1 {
		return r.bad("l1_size", uint64(h.L1Size), 36, "L1 table too small: %d entries needed for virtual size %d", needL1, h.Size)
	}
	if uint64(h.L1Size)*8 > maxL1Bytes {
		return r.bad("l1_size", uint64(h.L1Size), 36, "L1 table larger than %d bytes", maxL1Bytes)
	}
	if err := r.checkRange(h, "l1_table_offset", 40, h.L1TableOffset, uint64(h.L1Size)*8); err != nil {
		return err
	}
	if uint64(h.RefcountTableClusters)*cs > maxRefcountTableBytes {
		return r.bad("refcount_table_clusters", uint64(h.RefcountTableClusters), 56, "refcount table larger than %d bytes", maxRefcountTableBytes)
	}
	if h.RefcountTableClusters > 0 || h.RefcountTableOffset != 0 {
		if err := r.checkRange(h, "refcount_table_offset", 48, h.RefcountTableOffset, uint64(h.RefcountTableClusters)*cs); err != nil {
			return err
		}
	}
	if h.NbSnapshots > maxSnapshots {
		return r.bad("nb_snapshots", uint64(h.NbSnapshots), 60, "more than %d snapshots", maxSnapshots)
	}
	if err := r.checkRange(h, "snapshots_offset", 64, h.SnapshotsOffset, 0); err != nil {
		return err
	}
	return nil
}

// checkRange checks that a table offset is cluster aligned and that
// [off, off+length) lies inside the file. An empty table may have offset 0.
func (r *headerReader) checkRange(h *Header, field string, fieldOff int64, off, length uint64) error {
	if off%uint64(h.ClusterSize()) != 0 {
		return r.bad(field, off, fieldOff, "not aligned to the cluster size (%d)", h.ClusterSize())
	}
	if length == 0 {
		return nil
	}
	if off >= uint64(r.fileSize) || length > uint64(r.fileSize)-off {
		return r.bad(field, off, fieldOff, "table of %d bytes runs past the end of the file (%d bytes)", length, r.fileSize)
	}
	return nil
}

// parseExtensions walks the header extensions (specification, "Header
// extensions"). They end at the first end-of-extensions marker, at the
// backing file name, or at the end of the first cluster.
func (r *headerReader) parseExtensions(h *Header) error {
	start := int64(h.HeaderLength)
	end := h.ClusterSize()
	if h.BackingFileOffset != 0 && int64(h.BackingFileOffset) < end && int64(h.BackingFileOffset) >= start {
		end = int64(h.BackingFileOffset)
	}
	if end > int64(len(r.buf)) {
		end = int64(len(r.buf))
	}
	for off := start; off+8 <= end; {
		typ := r.u32(int(off))
		length := int64(r.u32(int(off + 4)))
		if typ == extEnd {
			return nil
		}
		data := off + 8
		if length > end-data {
			return r.bad("header extension length", uint64(length), off+4, "extension %#x runs past the end of the extension area (byte %d)", typ, end)
		}
		body := r.buf[data : data+length]
		switch typ {
		case extBackingFormat:
			if length > 15 {
				return r.bad("backing file format", uint64(length), off+4, "name longer than 15 bytes")
			}
			h.BackingFormat = string(bytes.TrimRight(body, "\x00"))
		case extFeatureTable:
			for i := int64(0); i+featureTableEntryBytes <= length; i += featureTableEntryBytes {
				e := body[i : i+featureTableEntryBytes]
				name := e[2:]
				if j := bytes.IndexByte(name, 0); j >= 0 {
					name = name[:j]
				}
				h.FeatureNames = append(h.FeatureNames, FeatureName{Type: e[0], Bit: e[1], Name: string(name)})
			}
		case extBitmaps:
			if length < 24 {
				return r.bad("bitmaps extension length", uint64(length), off+4, "shorter than 24 bytes")
			}
			h.HasBitmaps = true
			h.Bitmaps = BitmapsExtension{
				NbBitmaps:       binary.BigEndian.Uint32(body),
				DirectorySize:   binary.BigEndian.Uint64(body[8:]),
				DirectoryOffset: binary.BigEndian.Uint64(body[16:]),
			}
		case extCryptoHeader:
			h.CryptoHeaderFound = true
		case extDataFile:
			if length == 0 || length > maxBackingNameLen {
				return r.bad("data file name length", uint64(length), off+4, "must be between 1 and %d", maxBackingNameLen)
			}
			h.DataFile = string(body)
		}
		off = data + (length+7)&^7
	}
	return nil
}

// readBackingName reads the backing file name, which is stored without a
// terminating NUL at backing_file_offset.
func (r *headerReader) readBackingName(h *Header) error {
	if h.BackingFileOffset == 0 || h.BackingFileSize == 0 {
		// Like qemu: an empty name means no backing file.
		return nil
	}
	if h.BackingFileSize > maxBackingNameLen {
		return r.bad("backing_file_size", uint64(h.BackingFileSize), 16, "must be at most %d", maxBackingNameLen)
	}
	// qemu refuses a name that does not lie in the first cluster.
	end := h.BackingFileOffset + uint64(h.BackingFileSize)
	if h.BackingFileOffset < uint64(h.HeaderLength) || end > uint64(h.ClusterSize()) {
		return r.bad("backing_file_offset", h.BackingFileOffset, 8, "backing file name (%d bytes) must lie in the first cluster, after the header", h.BackingFileSize)
	}
	if end > uint64(len(r.buf)) {
		return r.bad("backing_file_offset", h.BackingFileOffset, 8, "backing file name runs past the end of the file")
	}
	h.BackingFile = string(r.buf[h.BackingFileOffset:end])
	return nil
}
