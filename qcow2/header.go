package qcow2

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/qcowfs/qcowfs/luks"
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
	// The full disk encryption header pointer (extension 0x0537be77):
	// where the LUKS header lies in the image file.
	CryptoHeaderOffset, CryptoHeaderLength uint64
	// Extensions are the header extensions of types this package does
	// not know, in file order. qemu keeps such extensions as they are
	// when it rewrites the header (block/qcow2.c, unknown_header_ext),
	// so a program may record facts of its own in an image.
	Extensions []Extension
}

// An Extension is a header extension (specification, "Header
// extensions"): its type and its data, without the padding.
type Extension struct {
	Type uint32
	Data []byte
}

// Extension returns the data of the first extension of type typ among
// the ones this package does not know (Header.Extensions).
func (h *Header) Extension(typ uint32) ([]byte, bool) {
	for _, e := range h.Extensions {
		if e.Type == typ {
			return e.Data, true
		}
	}
	return nil, false
}

// knownExtension reports whether this package (or qemu) gives extensions
// of type typ a meaning of their own.
func knownExtension(typ uint32) bool {
	switch typ {
	case extEnd, extBackingFormat, extFeatureTable, extBitmaps, extCryptoHeader, extDataFile:
		return true
	}
	return false
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

// virtualSize is the disk size qemu serves for a header's size field: it
// counts whole 512-byte sectors (block/qcow2.c: total_sectors = size /
// BDRV_SECTOR_SIZE), so the bytes of a last partial sector are not part of
// the disk.
func virtualSize(size uint64) int64 { return int64(size &^ 511) }

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

// headerField is one field of the fixed header (specification, "Header"):
// its name as the specification spells it, its byte offset and its width.
// The parser reads every field through this table, errors take the field's
// name and offset from it, and a header encoder writes through it, so an
// offset is written down once.
type headerField struct {
	name  string
	off   int64
	width int // bytes: 1, 4 or 8
}

var (
	fieldMagic                 = headerField{"magic", 0, 4}
	fieldVersion               = headerField{"version", 4, 4}
	fieldBackingFileOffset     = headerField{"backing_file_offset", 8, 8}
	fieldBackingFileSize       = headerField{"backing_file_size", 16, 4}
	fieldClusterBits           = headerField{"cluster_bits", 20, 4}
	fieldSize                  = headerField{"size", 24, 8}
	fieldCryptMethod           = headerField{"crypt_method", 32, 4}
	fieldL1Size                = headerField{"l1_size", 36, 4}
	fieldL1TableOffset         = headerField{"l1_table_offset", 40, 8}
	fieldRefcountTableOffset   = headerField{"refcount_table_offset", 48, 8}
	fieldRefcountTableClusters = headerField{"refcount_table_clusters", 56, 4}
	fieldNbSnapshots           = headerField{"nb_snapshots", 60, 4}
	fieldSnapshotsOffset       = headerField{"snapshots_offset", 64, 8}
	// Version 3 only.
	fieldIncompatibleFeatures = headerField{"incompatible_features", 72, 8}
	fieldCompatibleFeatures   = headerField{"compatible_features", 80, 8}
	fieldAutoclearFeatures    = headerField{"autoclear_features", 88, 8}
	fieldRefcountOrder        = headerField{"refcount_order", 96, 4}
	fieldHeaderLength         = headerField{"header_length", 100, 4}
	// Optional, present when header_length > 104.
	fieldCompressionType = headerField{"compression_type", 104, 1}
)

// get reads the field from a header buffer that holds it.
func (f headerField) get(b []byte) uint64 {
	switch f.width {
	case 1:
		return uint64(b[f.off])
	case 4:
		return uint64(binary.BigEndian.Uint32(b[f.off:]))
	default:
		return binary.BigEndian.Uint64(b[f.off:])
	}
}

// put writes v into the field of a header buffer.
func (f headerField) put(b []byte, v uint64) {
	switch f.width {
	case 1:
		b[f.off] = byte(v)
	case 4:
		binary.BigEndian.PutUint32(b[f.off:], uint32(v))
	default:
		binary.BigEndian.PutUint64(b[f.off:], v)
	}
}

// headerReader parses and validates the header of one file. Each field is
// checked where it is read; errors name the file, field, value and offset.
type headerReader struct {
	f        HostFile
	file     string
	fileSize int64
	buf      []byte // the first cluster (or the whole file if shorter)
}

func (r *headerReader) bad(f headerField, val uint64, format string, args ...any) error {
	return r.badAt(f.name, val, f.off, format, args...)
}

func (r *headerReader) badAt(field string, val uint64, off int64, format string, args ...any) error {
	return &FormatError{File: r.file, Field: field, Value: val, Offset: off, Msg: fmt.Sprintf(format, args...)}
}

// read fills r.buf with the first n bytes of the file (fewer if it is
// shorter).
func (r *headerReader) read(n int64) error {
	n = min(n, r.fileSize)
	r.buf = make([]byte, n)
	return readFull(r.f, r.buf, 0, "header")
}

func (r *headerReader) u32(off int64) uint32 { return binary.BigEndian.Uint32(r.buf[off:]) }

// readHeader reads and validates the header of the image in f, a file of
// fileSize bytes.
func readHeader(f HostFile, fileSize int64) (*Header, error) {
	r := &headerReader{f: f, file: f.Name(), fileSize: fileSize}
	// The header, its extensions and the backing file name all live in
	// the first cluster: read 4 KiB, then the rest of the cluster once
	// cluster_bits is known.
	if err := r.read(4096); err != nil {
		return nil, err
	}
	if len(r.buf) < 4 || fieldMagic.get(r.buf) != Magic {
		return nil, fmt.Errorf("%s: %w", r.file, ErrNotQcow2)
	}
	if len(r.buf) >= v2HeaderLen {
		if bits := fieldClusterBits.get(r.buf); bits >= minClusterBits && bits <= maxClusterBits && 1<<bits > len(r.buf) {
			if err := r.read(1 << bits); err != nil {
				return nil, err
			}
		}
	}
	if len(r.buf) < v2HeaderLen {
		return nil, r.badAt("header", uint64(len(r.buf)), 0, "file is %d bytes, shorter than a version 2 header (%d)", len(r.buf), v2HeaderLen)
	}
	return r.parse()
}

func (r *headerReader) parse() (*Header, error) {
	b := r.buf
	h := &Header{
		Version:               uint32(fieldVersion.get(b)),
		BackingFileOffset:     fieldBackingFileOffset.get(b),
		BackingFileSize:       uint32(fieldBackingFileSize.get(b)),
		ClusterBits:           uint32(fieldClusterBits.get(b)),
		Size:                  fieldSize.get(b),
		CryptMethod:           uint32(fieldCryptMethod.get(b)),
		L1Size:                uint32(fieldL1Size.get(b)),
		L1TableOffset:         fieldL1TableOffset.get(b),
		RefcountTableOffset:   fieldRefcountTableOffset.get(b),
		RefcountTableClusters: uint32(fieldRefcountTableClusters.get(b)),
		NbSnapshots:           uint32(fieldNbSnapshots.get(b)),
		SnapshotsOffset:       fieldSnapshotsOffset.get(b),
		RefcountOrder:         4,
		HeaderLength:          v2HeaderLen,
	}
	if h.Version != 2 && h.Version != 3 {
		return nil, &UnsupportedError{File: r.file, Feature: fmt.Sprintf("qcow2 version %d", h.Version)}
	}
	if h.ClusterBits < minClusterBits || h.ClusterBits > maxClusterBits {
		return nil, r.bad(fieldClusterBits, uint64(h.ClusterBits), "must be between %d and %d", minClusterBits, maxClusterBits)
	}
	clusterSize := h.ClusterSize()

	if h.Version == 3 {
		if len(b) < v3HeaderLen {
			return nil, r.bad(fieldHeaderLength, uint64(len(b)), "file too short for a version 3 header")
		}
		h.IncompatibleFeatures = fieldIncompatibleFeatures.get(b)
		h.CompatibleFeatures = fieldCompatibleFeatures.get(b)
		h.AutoclearFeatures = fieldAutoclearFeatures.get(b)
		h.RefcountOrder = uint32(fieldRefcountOrder.get(b))
		h.HeaderLength = uint32(fieldHeaderLength.get(b))
		if h.HeaderLength < v3HeaderLen || h.HeaderLength%8 != 0 || int64(h.HeaderLength) > clusterSize {
			return nil, r.bad(fieldHeaderLength, uint64(h.HeaderLength), "must be at least %d, a multiple of 8 and at most the cluster size", v3HeaderLen)
		}
		if int(h.HeaderLength) > len(b) {
			return nil, r.bad(fieldHeaderLength, uint64(h.HeaderLength), "runs past the end of the file (%d bytes)", r.fileSize)
		}
		if h.RefcountOrder > maxRefcountOrder {
			return nil, r.bad(fieldRefcountOrder, uint64(h.RefcountOrder), "must be at most %d", maxRefcountOrder)
		}
		if h.HeaderLength > v3HeaderLen {
			h.CompressionType = uint8(fieldCompressionType.get(b))
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
		return nil, r.bad(fieldCompressionType, uint64(h.CompressionType), "unknown compression type")
	case (h.CompressionType != compressionDeflate) != hasCompressionBit:
		return nil, r.bad(fieldCompressionType, uint64(h.CompressionType), "must be non-zero exactly when incompatible bit 3 is set (incompatible_features %#x)", h.IncompatibleFeatures)
	}
	if h.ExtendedL2() && h.ClusterBits < 14 {
		return nil, r.bad(fieldClusterBits, uint64(h.ClusterBits), "extended L2 entries need clusters of at least 16 KiB")
	}
	if h.IncompatibleFeatures&IncompatExternalData != 0 && h.DataFile == "" {
		return nil, r.bad(fieldIncompatibleFeatures, h.IncompatibleFeatures, "external data file bit set but no data file name extension")
	}
	if h.IncompatibleFeatures&IncompatExternalData == 0 && h.AutoclearFeatures&AutoclearDataFileRaw != 0 {
		// qemu clears this autoclear bit when there is no data file;
		// it carries no meaning here.
		h.AutoclearFeatures &^= AutoclearDataFileRaw
	}

	switch h.CryptMethod {
	case cryptNone, cryptAES:
	case cryptLUKS:
		if !h.CryptoHeaderFound {
			return nil, r.bad(fieldCryptMethod, uint64(h.CryptMethod), "LUKS encryption without a crypto header extension")
		}
		if h.CryptoHeaderLength > luks.MaxHeaderBytes {
			return nil, r.bad(fieldCryptMethod, h.CryptoHeaderLength, "the LUKS header is longer than %d bytes", luks.MaxHeaderBytes)
		}
		if h.CryptoHeaderOffset > uint64(r.fileSize) || h.CryptoHeaderLength > uint64(r.fileSize)-h.CryptoHeaderOffset {
			return nil, r.bad(fieldCryptMethod, h.CryptoHeaderOffset, "the LUKS header (%d bytes) runs past the end of the file", h.CryptoHeaderLength)
		}
	default:
		return nil, r.bad(fieldCryptMethod, uint64(h.CryptMethod), "unknown encryption method")
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
		return r.bad(fieldSize, h.Size, "virtual size too large")
	}
	needL1 := (h.Size + l1Span - 1) / l1Span
	if needL1 > maxL1Bytes/8 {
		return r.bad(fieldSize, h.Size, "image too big: it needs %d L1 entries, more than the %d qemu allows", needL1, maxL1Bytes/8)
	}
	if uint64(h.L1Size) < needL1 {
		return r.bad(fieldL1Size, uint64(h.L1Size), "L1 table too small: %d entries needed for virtual size %d", needL1, h.Size)
	}
	if uint64(h.L1Size)*8 > maxL1Bytes {
		return r.bad(fieldL1Size, uint64(h.L1Size), "L1 table larger than %d bytes", maxL1Bytes)
	}
	if err := r.checkRange(h, fieldL1TableOffset, h.L1TableOffset, uint64(h.L1Size)*8); err != nil {
		return err
	}
	if uint64(h.RefcountTableClusters)*cs > maxRefcountTableBytes {
		return r.bad(fieldRefcountTableClusters, uint64(h.RefcountTableClusters), "refcount table larger than %d bytes", maxRefcountTableBytes)
	}
	if h.RefcountTableClusters > 0 || h.RefcountTableOffset != 0 {
		if err := r.checkRange(h, fieldRefcountTableOffset, h.RefcountTableOffset, uint64(h.RefcountTableClusters)*cs); err != nil {
			return err
		}
	}
	if h.NbSnapshots > maxSnapshots {
		return r.bad(fieldNbSnapshots, uint64(h.NbSnapshots), "more than %d snapshots", maxSnapshots)
	}
	if err := r.checkRange(h, fieldSnapshotsOffset, h.SnapshotsOffset, 0); err != nil {
		return err
	}
	return nil
}

// checkRange checks that a table offset is cluster aligned and that
// [off, off+length) lies inside the file. An empty table may have offset 0.
func (r *headerReader) checkRange(h *Header, f headerField, off, length uint64) error {
	if off%uint64(h.ClusterSize()) != 0 {
		return r.bad(f, off, "not aligned to the cluster size (%d)", h.ClusterSize())
	}
	if length == 0 {
		return nil
	}
	if off >= uint64(r.fileSize) || length > uint64(r.fileSize)-off {
		return r.bad(f, off, "table of %d bytes runs past the end of the file (%d bytes)", length, r.fileSize)
	}
	return nil
}

// ProbeSize is how many of a file's first bytes Probe looks at.
const ProbeSize = 8

// Probe reports whether qemu takes a file whose first bytes are head
// (fewer than ProbeSize if the file is that short) for a qcow2 image, as
// its format probe (block/qcow2.c, qcow2_probe) decides: the magic, and a
// version (bytes 4-7) other than 0. qemu probes a buffer that reads as
// zeros past the end of the file, so a file holding the magic alone has
// version 0 and is a raw image to qemu. (Version 1 is qemu's older qcow
// format, which Open refuses, naming the version.)
func Probe(head []byte) bool {
	var b [ProbeSize]byte
	copy(b[:], head)
	return binary.BigEndian.Uint32(b[:4]) == Magic && binary.BigEndian.Uint32(b[4:]) != 0
}

// ProbeFile reads f's first bytes and Probes them.
func ProbeFile(f io.ReaderAt) (bool, error) {
	var b [ProbeSize]byte
	n, err := f.ReadAt(b[:], 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return false, err
	}
	return Probe(b[:n]), nil
}
