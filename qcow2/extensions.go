package qcow2

import (
	"bytes"
	"encoding/binary"
)

// parseExtensions walks the header extensions (specification, "Header
// extensions"). They end at the first end-of-extensions marker, at the
// backing file name, or at the end of the first cluster.
func (r *headerReader) parseExtensions(h *Header) error {
	start := int64(h.HeaderLength)
	end := h.ClusterSize()
	if h.BackingFileOffset != 0 && h.BackingFileOffset < uint64(end) && h.BackingFileOffset >= uint64(start) {
		end = int64(h.BackingFileOffset)
	}
	if end > int64(len(r.buf)) {
		end = int64(len(r.buf))
	}
	for off := start; off+8 <= end; {
		typ := r.u32(off)
		length := int64(r.u32(off + 4))
		if typ == extEnd {
			return nil
		}
		data := off + 8
		if length > end-data {
			return r.badAt("header extension length", uint64(length), off+4, "extension %#x runs past the end of the extension area (byte %d)", typ, end)
		}
		body := r.buf[data : data+length]
		switch typ {
		case extBackingFormat:
			if length > 15 {
				return r.badAt("backing file format", uint64(length), off+4, "name longer than 15 bytes")
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
			if length != 24 {
				// qemu: "bitmaps_ext: Invalid extension length".
				return r.badAt("bitmaps extension length", uint64(length), off+4, "must be 24 bytes")
			}
			h.HasBitmaps = true
			h.Bitmaps = BitmapsExtension{
				NbBitmaps:       binary.BigEndian.Uint32(body),
				DirectorySize:   binary.BigEndian.Uint64(body[8:]),
				DirectoryOffset: binary.BigEndian.Uint64(body[16:]),
			}
		case extCryptoHeader:
			// qemu: "Invalid encryption header extension length",
			// "Encryption header offset ... is not a multiple of
			// cluster size".
			if length != 16 {
				return r.badAt("crypto header extension length", uint64(length), off+4, "must be 16 bytes")
			}
			h.CryptoHeaderFound = true
			h.CryptoHeaderOffset = binary.BigEndian.Uint64(body)
			h.CryptoHeaderLength = binary.BigEndian.Uint64(body[8:])
			if h.CryptoHeaderOffset%uint64(h.ClusterSize()) != 0 {
				return r.badAt("crypto header offset", h.CryptoHeaderOffset, data, "not a multiple of the cluster size")
			}
		case extDataFile:
			if length == 0 || length > maxBackingNameLen {
				return r.badAt("data file name length", uint64(length), off+4, "must be between 1 and %d", maxBackingNameLen)
			}
			h.DataFile = string(body)
		default:
			h.Extensions = append(h.Extensions, Extension{Type: typ, Data: bytes.Clone(body)})
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
		return r.bad(fieldBackingFileSize, uint64(h.BackingFileSize), "must be at most %d", maxBackingNameLen)
	}
	// qemu refuses a name that does not lie in the first cluster. (The
	// offset is checked before the sum is formed: it may be near 2^64.)
	cs := uint64(h.ClusterSize())
	if h.BackingFileOffset < uint64(h.HeaderLength) || h.BackingFileOffset > cs || uint64(h.BackingFileSize) > cs-h.BackingFileOffset {
		return r.bad(fieldBackingFileOffset, h.BackingFileOffset, "backing file name (%d bytes) must lie in the first cluster, after the header", h.BackingFileSize)
	}
	end := h.BackingFileOffset + uint64(h.BackingFileSize)
	if end > uint64(len(r.buf)) {
		return r.bad(fieldBackingFileOffset, h.BackingFileOffset, "backing file name runs past the end of the file")
	}
	h.BackingFile = string(r.buf[h.BackingFileOffset:end])
	return nil
}
