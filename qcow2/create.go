package qcow2

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/qcowfs/qcowfs/luks"
	"golang.org/x/sys/unix"
)

// Creating images: a version 3 image laid out as qemu-img create lays it
// out (the header cluster with the backing format and, in clusters of
// 8 KiB and more, feature name table extensions and the backing file name;
// then the refcount table, its first refcount block, the L1 table, and any
// further refcount blocks), so that qemu-img info and check say the same of
// both, and the bytes are the same but for the order of refcount blocks
// beyond the first.

// CreateOptions describe an image to create.
type CreateOptions struct {
	Size          int64  // virtual size in bytes (a multiple of 512)
	ClusterSize   int64  // 0: 64 KiB
	Backing       string // backing file name as stored ("" for none)
	BackingFormat string // "qcow2", "raw", or "" (not recorded)
	ExtendedL2    bool
	// Extensions are header extensions of the caller's own (types this
	// package and qemu do not know), written after the known ones; qemu
	// keeps them when it rewrites the header (Header.Extensions).
	Extensions []Extension
	// Encrypt, if set, makes a LUKS-encrypted image (crypt_method 2):
	// its header, with a fresh master key under Passphrase in key slot
	// 0, in clusters after the L1 table, as qemu-img create lays it out.
	Encrypt *Encryption
}

// Encryption is what a new encrypted image is made with.
type Encryption struct {
	Passphrase []byte
	Params     luks.Params
}

// featureTable is the feature name table qemu writes.
var featureTable = []FeatureName{
	{0, 0, "dirty bit"}, {0, 1, "corrupt bit"}, {0, 2, "external data file"},
	{0, 3, "compression type"}, {0, 4, "extended L2 entries"},
	{1, 0, "lazy refcounts"},
	{2, 0, "bitmaps"}, {2, 1, "raw external data"},
}

// Create writes a new image at path, atomically: it is written under a
// temporary name in the same folder, synced, renamed into place (never
// over an existing file) and the folder synced, so that a crash leaves
// either no image or a whole one. An existing file at path is an error
// (wrapping os.ErrExist).
func Create(path string, o CreateOptions) error {
	p, err := Prepare(path, o)
	if err != nil {
		return err
	}
	return p.Publish()
}

// A Prepared image is written and synced under a temporary name, waiting
// to be published under its own.
type Prepared struct {
	path, tmp string
}

// Prepare does the first half of Create: it writes the image under a
// hidden temporary name next to path (".NAME.tmp-RANDOM") and syncs it.
// The caller Publishes or Abandons it.
func Prepare(path string, o CreateOptions) (*Prepared, error) {
	img, err := encodeImage(o)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if _, err := os.Lstat(path); err == nil {
		return nil, fmt.Errorf("%s: %w", path, os.ErrExist)
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return nil, err
	}
	err = tmp.Chmod(0o644)
	if err == nil {
		_, err = tmp.Write(img)
	}
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(tmp.Name())
		return nil, err
	}
	return &Prepared{path: path, tmp: tmp.Name()}, nil
}

// Temp is the temporary name the image is written under.
func (p *Prepared) Temp() string { return p.tmp }

// Publish renames the image into place, unless a file appeared there
// meanwhile (then the temporary file is removed and the error wraps
// os.ErrExist), and syncs the folder.
func (p *Prepared) Publish() error {
	err := unix.Renameat2(unix.AT_FDCWD, p.tmp, unix.AT_FDCWD, p.path, unix.RENAME_NOREPLACE)
	if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) {
		// A file system without RENAME_NOREPLACE: a hard link fails
		// on an existing name just the same.
		if err = os.Link(p.tmp, p.path); err == nil {
			err = os.Remove(p.tmp)
		}
	}
	if err != nil {
		os.Remove(p.tmp)
		if errors.Is(err, unix.EEXIST) || errors.Is(err, os.ErrExist) {
			return fmt.Errorf("%s: %w", p.path, os.ErrExist)
		}
		return &os.LinkError{Op: "rename", Old: p.tmp, New: p.path, Err: err}
	}
	return syncDir(filepath.Dir(p.path))
}

// Abandon removes the temporary file.
func (p *Prepared) Abandon() { os.Remove(p.tmp) }

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// encodeImage returns the bytes of a new image.
func encodeImage(o CreateOptions) ([]byte, error) {
	cs := o.ClusterSize
	if cs == 0 {
		cs = 65536
	}
	bits := uint32(0)
	for int64(1)<<bits < cs {
		bits++
	}
	switch {
	case int64(1)<<bits != cs || bits < minClusterBits || bits > maxClusterBits:
		return nil, fmt.Errorf("cluster size %d: not a power of two from 512 B to 2 MiB", cs)
	case o.ExtendedL2 && bits < 14:
		return nil, fmt.Errorf("extended L2 entries need clusters of at least 16 KiB")
	case o.Size < 0 || o.Size%512 != 0 || o.Size > 1<<62:
		return nil, fmt.Errorf("size %d: not a multiple of 512", o.Size)
	case len(o.Backing) > maxBackingNameLen:
		return nil, fmt.Errorf("backing file name longer than %d bytes", maxBackingNameLen)
	case len(o.BackingFormat) > 15:
		return nil, fmt.Errorf("backing format %q too long", o.BackingFormat)
	}
	for _, e := range o.Extensions {
		if knownExtension(e.Type) {
			return nil, fmt.Errorf("header extension type %#x: a type of the format's own", e.Type)
		}
	}
	entry := int64(8)
	if o.ExtendedL2 {
		entry = 16
	}
	l1Span := cs / entry * cs
	l1Entries := (o.Size + l1Span - 1) / l1Span
	if l1Entries*8 > maxL1Bytes {
		return nil, fmt.Errorf("size %d needs more L1 entries than qemu allows", o.Size)
	}
	l1Clusters := max(1, (l1Entries*8+cs-1)/cs)
	var area []byte
	if o.Encrypt != nil {
		a, _, c, err := luks.Create(o.Encrypt.Params, o.Encrypt.Passphrase)
		if err != nil {
			return nil, err
		}
		c.Close()
		area = a
	}
	cryptClusters := (int64(len(area)) + cs - 1) / cs

	// The layout: header, refcount table, the first refcount block, the
	// L1 table, the LUKS header of an encrypted image, and after them
	// the refcount blocks that counting them needs (where qemu's
	// allocator puts them); the blocks count every cluster of it, the
	// table names every block.
	perBlock := cs * 8 / 16
	rt, rb := int64(1), int64(1)
	for {
		total := 1 + rt + rb + l1Clusters + cryptClusters
		needRB := (total + perBlock - 1) / perBlock
		needRT := (needRB*8 + cs - 1) / cs
		if needRB == rb && needRT == rt {
			break
		}
		rb, rt = max(rb, needRB), max(rt, needRT)
	}
	rtOff, l1Off := cs, (2+rt)*cs
	cryptOff := l1Off + l1Clusters*cs
	rbOffs := []int64{(1 + rt) * cs}
	for i := int64(1); i < rb; i++ {
		rbOffs = append(rbOffs, (2+rt+l1Clusters+cryptClusters+i-1)*cs)
	}
	total := 1 + rt + rb + l1Clusters + cryptClusters
	// qemu's file ends right after the L1 table (the rest of its last
	// cluster is not written), or after the LUKS header or the last
	// refcount block.
	end := l1Off + max(8, l1Entries*8)
	if cryptClusters > 0 {
		end = cryptOff + int64(len(area))
	}
	if rb > 1 {
		end = rbOffs[rb-1] + cs
	}
	buf := make([]byte, end)
	if cryptClusters > 0 {
		copy(buf[cryptOff:], area)
		clear(area)
	}

	h := buf[:cs]
	fieldMagic.put(h, Magic)
	fieldVersion.put(h, 3)
	fieldClusterBits.put(h, uint64(bits))
	fieldSize.put(h, uint64(o.Size))
	fieldL1Size.put(h, uint64(l1Entries))
	fieldL1TableOffset.put(h, uint64(l1Off))
	fieldRefcountTableOffset.put(h, uint64(rtOff))
	fieldRefcountTableClusters.put(h, uint64(rt))
	if o.ExtendedL2 {
		fieldIncompatibleFeatures.put(h, IncompatExtendedL2)
	}
	fieldRefcountOrder.put(h, 4)
	fieldHeaderLength.put(h, 112)
	// Extensions, each padded to 8 bytes.
	p := 112
	ext := func(typ uint32, data []byte) {
		binary.BigEndian.PutUint32(h[p:], typ)
		binary.BigEndian.PutUint32(h[p+4:], uint32(len(data)))
		copy(h[p+8:], data)
		p += 8 + (len(data)+7)&^7
	}
	if o.BackingFormat != "" {
		ext(extBackingFormat, []byte(o.BackingFormat))
	}
	if cryptClusters > 0 {
		fieldCryptMethod.put(h, cryptLUKS)
		var ch [16]byte
		binary.BigEndian.PutUint64(ch[:], uint64(cryptOff))
		binary.BigEndian.PutUint64(ch[8:], uint64(len(area)))
		ext(extCryptoHeader, ch[:])
	}
	if cs >= 8192 {
		// (qemu leaves the feature name table out of smaller
		// header clusters.)
		ft := make([]byte, len(featureTable)*featureTableEntryBytes)
		for i, f := range featureTable {
			e := ft[i*featureTableEntryBytes:]
			e[0], e[1] = f.Type, f.Bit
			copy(e[2:featureTableEntryBytes], f.Name)
		}
		ext(extFeatureTable, ft)
	}
	for _, e := range o.Extensions {
		// (Room for the extension, padded, and the end marker.)
		if p+8+(len(e.Data)+7)&^7+8 > int(cs) {
			return nil, fmt.Errorf("header extension %#x (%d bytes) does not fit in the header cluster", e.Type, len(e.Data))
		}
		ext(e.Type, e.Data)
	}
	p += 8 // the end marker (zeros)
	if o.Backing != "" {
		if p+len(o.Backing) > int(cs) {
			return nil, fmt.Errorf("backing file name does not fit in the header cluster")
		}
		fieldBackingFileOffset.put(h, uint64(p))
		fieldBackingFileSize.put(h, uint64(len(o.Backing)))
		copy(h[p:], o.Backing)
	}
	// The refcount table and blocks: every cluster of the layout has
	// refcount 1.
	for i, off := range rbOffs {
		binary.BigEndian.PutUint64(buf[rtOff+int64(i)*8:], uint64(off))
	}
	for c := int64(0); c < total; c++ {
		blk := rbOffs[c/perBlock]
		binary.BigEndian.PutUint16(buf[blk+c%perBlock*2:], 1)
	}
	return buf, nil
}
