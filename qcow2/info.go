package qcow2

import (
	"fmt"

	"github.com/qcowfs/qcowfs/luks"
)

// Info is the summary `qemu-img info --output=json` prints for a qcow2
// image, with the same JSON field names, so scripts written for qemu-img
// read it unchanged.
type Info struct {
	VirtualSize int64  `json:"virtual-size"`
	Filename    string `json:"filename"`
	Format      string `json:"format"`
	ClusterSize int64  `json:"cluster-size"`
	// ActualSize is the space the image file takes on its host; nil for
	// a remote file, whose size on disk qemu's curl driver cannot tell
	// either ("disk size: unavailable").
	ActualSize            *int64         `json:"actual-size,omitempty"`
	DirtyFlag             bool           `json:"dirty-flag"`
	BackingFilename       string         `json:"backing-filename,omitempty"`
	FullBackingFilename   string         `json:"full-backing-filename,omitempty"`
	BackingFilenameFormat string         `json:"backing-filename-format,omitempty"`
	Snapshots             []SnapshotInfo `json:"snapshots,omitempty"`
	FormatSpecific        FormatSpecific `json:"format-specific"`
	// Encrypted is set for an encrypted image (opened with its
	// passphrase, or described without it by DescribeEncrypted).
	Encrypted bool `json:"encrypted,omitempty"`
}

// SnapshotInfo is one snapshot as qemu-img info lists it.
type SnapshotInfo struct {
	ID          string  `json:"id"`
	Name        string  `json:"name"`
	VMStateSize uint64  `json:"vm-state-size"`
	DateSec     uint32  `json:"date-sec"`
	DateNsec    uint32  `json:"date-nsec"`
	VMClockSec  uint64  `json:"vm-clock-sec"`
	VMClockNsec uint64  `json:"vm-clock-nsec"`
	Icount      *uint64 `json:"icount,omitempty"`
}

// FormatSpecific is qemu's "format-specific" object.
type FormatSpecific struct {
	Type string       `json:"type"`
	Data Qcow2Details `json:"data"`
}

// Qcow2Details is the qcow2 part of Info. Fields qemu prints only for
// version 3 images are pointers, nil for version 2.
type Qcow2Details struct {
	Compat          string   `json:"compat"`
	CompressionType string   `json:"compression-type"`
	LazyRefcounts   *bool    `json:"lazy-refcounts,omitempty"`
	Bitmaps         []Bitmap `json:"bitmaps,omitempty"`
	RefcountBits    int      `json:"refcount-bits"`
	DataFile        string   `json:"data-file,omitempty"`
	DataFileRaw     *bool    `json:"data-file-raw,omitempty"`
	Encrypt         *Encrypt `json:"encrypt,omitempty"`
	Corrupt         *bool    `json:"corrupt,omitempty"`
	ExtendedL2      *bool    `json:"extended-l2,omitempty"`
}

// Info returns the image's summary.
func (img *Image) Info() Info {
	l := img.top
	h := l.hdr
	info := headerInfo(h, l.name, l.file)
	for _, sn := range img.snapshots {
		si := SnapshotInfo{
			ID: sn.ID, Name: sn.Name, VMStateSize: sn.VMStateSize,
			DateSec: sn.DateSec, DateNsec: sn.DateNsec,
			VMClockSec: sn.VMClockNsec / 1e9, VMClockNsec: sn.VMClockNsec % 1e9,
		}
		if sn.Icount != ^uint64(0) {
			si.Icount = ptr(sn.Icount)
		}
		info.Snapshots = append(info.Snapshots, si)
	}
	if h.Version >= 3 {
		info.FormatSpecific.Data.Bitmaps = img.Bitmaps()
	}
	if l.crypt != nil {
		info.Encrypted = true
		info.FormatSpecific.Data.Encrypt = encryptInfo(l.crypt.header)
	}
	return info
}

// headerInfo is the part of Info the header alone tells, for the image
// file f opened as name.
func headerInfo(h *Header, name string, f HostFile) Info {
	info := Info{
		VirtualSize: virtualSize(h.Size),
		Filename:    name,
		Format:      "qcow2",
		ClusterSize: h.ClusterSize(),
		DirtyFlag:   h.IncompatibleFeatures&IncompatDirty != 0,
		FormatSpecific: FormatSpecific{Type: "qcow2", Data: Qcow2Details{
			Compat:          "0.10",
			CompressionType: h.CompressionName(),
			RefcountBits:    1 << h.RefcountOrder,
		}},
	}
	if fileOf(f) != nil {
		info.ActualSize = ptr(allocatedBytes(f))
	}
	if h.BackingFile != "" {
		info.BackingFilename = h.BackingFile
		info.FullBackingFilename = FullBackingName(name, h.BackingFile)
		info.BackingFilenameFormat = h.BackingFormat
	}
	if h.Version >= 3 {
		d := &info.FormatSpecific.Data
		d.Compat = "1.1"
		d.LazyRefcounts = ptr(h.CompatibleFeatures&CompatLazyRefcounts != 0)
		d.Corrupt = ptr(h.IncompatibleFeatures&IncompatCorrupt != 0)
		d.ExtendedL2 = ptr(h.ExtendedL2())
		if h.DataFile != "" {
			d.DataFile = h.DataFile
			d.DataFileRaw = ptr(h.AutoclearFeatures&AutoclearDataFileRaw != 0)
		}
	}
	return info
}

func ptr[T any](v T) *T { return &v }

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

// encryptInfo is what qemu-img info says of an image's encryption: legacy
// AES (h nil), or LUKS with header h's parameters.
func encryptInfo(h *luks.Header) *Encrypt {
	if h == nil {
		return &Encrypt{Format: "aes"}
	}
	s := h.Spec()
	li := &LUKSInfo{
		CipherAlg: s.CipherAlg, CipherMode: s.CipherMode, IvgenAlg: s.IvgenAlg, IvgenHashAlg: s.IvgenHashAlg,
		HashAlg:        s.HashAlg,
		PayloadOffset:  int64(h.PayloadOffset) * luks.SectorSize,
		MasterKeyIters: h.MKDigestIter,
		UUID:           h.UUID,
	}
	for _, sl := range h.Slots {
		ls := LUKSSlot{Active: sl.Active, KeyOffset: int64(sl.KeyOffset) * luks.SectorSize}
		if sl.Active {
			ls.Iters, ls.Stripes = ptr(sl.Iterations), ptr(sl.Stripes)
		}
		li.Slots = append(li.Slots, ls)
	}
	return &Encrypt{Format: "luks", LUKSInfo: li}
}

// DescribeEncrypted describes the encrypted qcow2 image at path without
// its key, as qemu-img info does (it opens the image without I/O, so
// never unlocks it), without the snapshot and bitmap lists (which would
// need the image opened): the header as Open reads it, and the LUKS
// header as Open parses it. It fails with ErrNotEncrypted for an image
// that is not encrypted.
func DescribeEncrypted(path string) (Info, error) {
	f, err := OpenFile(path)
	if err != nil {
		return Info{}, err
	}
	defer f.Close()
	size, err := f.Size()
	if err != nil {
		return Info{}, err
	}
	h, err := readHeader(f, size)
	if err != nil {
		return Info{}, err
	}
	var lh *luks.Header
	switch h.CryptMethod {
	case cryptNone:
		return Info{}, fmt.Errorf("%s: %w", path, ErrNotEncrypted)
	case cryptLUKS:
		if _, lh, err = readLUKSHeader(f, h, luks.HeaderLen); err != nil {
			return Info{}, err
		}
	}
	info := headerInfo(h, path, f)
	info.Encrypted = true
	info.FormatSpecific.Data.Encrypt = encryptInfo(lh)
	return info, nil
}
