package qcow2

import (
	"encoding/binary"
	"fmt"
)

// Internal snapshots (specification, "Snapshots").
//
// The snapshot table (snapshots_offset, nb_snapshots) holds one variable
// length entry per snapshot, each padded to a multiple of 8 bytes:
//
//	 0: l1_table_offset (u64)   8: l1_size (u32)
//	12: id_str_size (u16)      14: name_size (u16)
//	16: date_sec (u32)         20: date_nsec (u32)
//	24: vm_clock_nsec (u64)    32: vm_state_size (u32)
//	36: extra_data_size (u32)  40: extra data, then id, then name
//
// Extra data, when long enough: vm_state_size_large (u64), disk_size
// (u64, the snapshot's virtual size), icount (u64). Each snapshot has its
// own L1 table; its L2 tables and clusters may be shared with the image.
//
// Limits are qemu's (block/qcow2.h): at most QCOW_MAX_SNAPSHOTS entries,
// at most QCOW_MAX_SNAPSHOTS_SIZE bytes of table, at most
// QCOW_MAX_SNAPSHOT_EXTRA_DATA bytes of extra data per entry; a table
// beyond them refuses the image, as qemu does. An entry that qemu can list
// but not load (its L1 table is unaligned, too large or outside the file,
// its disk size is not a whole number of sectors or needs a larger L1 table
// than qemu allows) is kept in the list, with the reason in Snapshot.Err:
// the image itself, and its other snapshots, stay readable.

const (
	// maxSnapshotExtra is QCOW_MAX_SNAPSHOT_EXTRA_DATA.
	maxSnapshotExtra = 1024
	// maxSnapshotTableBytes is QCOW_MAX_SNAPSHOTS_SIZE: 1 KiB on
	// average per entry.
	maxSnapshotTableBytes = 1024 * maxSnapshots
	// snapshotFixedBytes is the fixed part of an entry.
	snapshotFixedBytes = 40
	// snapshotStructBytes is what one parsed Snapshot costs in memory
	// besides its ID and name, for the memory budget.
	snapshotStructBytes = 160
)

// Snapshot describes one internal snapshot.
type Snapshot struct {
	ID            string
	Name          string
	DateSec       uint32
	DateNsec      uint32
	VMClockNsec   uint64
	VMStateSize   uint64
	Size          int64  // virtual size of the disk when the snapshot was taken
	Icount        uint64 // instruction count; ^0 if unknown
	L1TableOffset uint64
	L1Size        uint32

	// Err, when not nil, says why the snapshot cannot be opened (qemu
	// cannot load it either); opening it fails with Err.
	Err error

	entryOff int64 // byte offset of the entry in the image file
}

// loadable reports whether the snapshot's L1 table can be read: the table
// lies in the file and the snapshot can be opened.
func (s *Snapshot) loadable() bool { return s.Err == nil }

// seqReader reads a region of the image file front to back through a
// buffer, so that a table of many small entries costs a few large reads.
type seqReader struct {
	m     *metaFile
	buf   []byte
	start int64 // file offset of buf[0]
	end   int64 // the end of the region read
}

// bytes returns the n bytes at file offset off (off at or after the last
// call's), valid until the next call; what names them for errors.
func (r *seqReader) bytes(off, n int64, what string) ([]byte, error) {
	if off < r.start || off+n > r.start+int64(len(r.buf)) {
		size := max(n, 1<<20)
		size = min(size, r.end-off)
		if size < n {
			return nil, fmt.Errorf("%s: %s at byte offset %d runs past the end of the table: %w", r.m.name(), what, off, ErrCorrupt)
		}
		if cap(r.buf) < int(size) {
			r.buf = make([]byte, size)
		}
		r.buf = r.buf[:size]
		if err := r.m.read(r.buf, off, what); err != nil {
			return nil, err
		}
		r.start = off
	}
	return r.buf[off-r.start : off-r.start+n], nil
}

// readSnapshots parses the snapshot table of the qcow2 file m, returning
// the snapshots and the table's size in bytes. size is the image's virtual
// size (the disk size of entries too short to have their own). Every field
// is checked against the file and the specification where it is read.
func readSnapshots(m *metaFile, h *Header, size int64, budget *charge) ([]Snapshot, int64, error) {
	name, fileSize := m.name(), m.size
	if h.NbSnapshots == 0 {
		return nil, 0, nil
	}
	bad := func(field string, val uint64, off int64, format string, args ...any) error {
		return &FormatError{File: name, Field: field, Value: val, Offset: off, Msg: fmt.Sprintf(format, args...)}
	}
	// The header check has made snapshots_offset cluster aligned; it
	// must lie in the file, so that offsets below never wrap.
	if h.SnapshotsOffset >= uint64(fileSize) {
		return nil, 0, bad(fieldSnapshotsOffset.name, h.SnapshotsOffset, fieldSnapshotsOffset.off, "snapshot table starts past the end of the file (%d bytes)", fileSize)
	}
	start := int64(h.SnapshotsOffset)
	r := &seqReader{m: m, end: min(fileSize, start+maxSnapshotTableBytes)}
	if err := budget.add(int64(h.NbSnapshots)*snapshotStructBytes, "snapshot table"); err != nil {
		return nil, 0, err
	}
	cs := h.ClusterSize()
	snaps := make([]Snapshot, 0, h.NbSnapshots)
	off := start
	be := binary.BigEndian
	for i := uint32(0); i < h.NbSnapshots; i++ {
		if off-start+snapshotFixedBytes > maxSnapshotTableBytes {
			return nil, 0, bad("snapshot table", uint64(i), fieldNbSnapshots.off, "larger than %d bytes at snapshot %d", maxSnapshotTableBytes, i)
		}
		if off+snapshotFixedBytes > fileSize {
			return nil, 0, bad("snapshot table", uint64(i), fieldNbSnapshots.off, "snapshot %d's entry at byte offset %d runs past the end of the file", i, off)
		}
		fixed, err := r.bytes(off, snapshotFixedBytes, "snapshot table")
		if err != nil {
			return nil, 0, err
		}
		s := Snapshot{
			L1TableOffset: be.Uint64(fixed[0:]),
			L1Size:        be.Uint32(fixed[8:]),
			DateSec:       be.Uint32(fixed[16:]),
			DateNsec:      be.Uint32(fixed[20:]),
			VMClockNsec:   be.Uint64(fixed[24:]),
			VMStateSize:   uint64(be.Uint32(fixed[32:])),
			Size:          size,
			Icount:        ^uint64(0),
			entryOff:      off,
		}
		idLen := int64(be.Uint16(fixed[12:]))
		nameLen := int64(be.Uint16(fixed[14:]))
		extraLen := int64(be.Uint32(fixed[36:]))
		if extraLen > maxSnapshotExtra {
			return nil, 0, bad("snapshot extra_data_size", uint64(extraLen), off+36, "larger than %d", maxSnapshotExtra)
		}
		varLen := extraLen + idLen + nameLen
		if off-start+snapshotFixedBytes+varLen > maxSnapshotTableBytes {
			return nil, 0, bad("snapshot table", uint64(i), fieldNbSnapshots.off, "larger than %d bytes at snapshot %d", maxSnapshotTableBytes, i)
		}
		if off+snapshotFixedBytes+varLen > fileSize {
			return nil, 0, bad("snapshot entry", uint64(varLen), off, "snapshot %d's entry runs past the end of the file", i)
		}
		buf, err := r.bytes(off+snapshotFixedBytes, varLen, "snapshot table")
		if err != nil {
			return nil, 0, err
		}
		extra := buf[:extraLen]
		if len(extra) >= 8 {
			s.VMStateSize = be.Uint64(extra[0:])
		}
		if len(extra) >= 16 {
			s.Size = int64(be.Uint64(extra[8:]))
		}
		if len(extra) >= 24 {
			s.Icount = be.Uint64(extra[16:])
		}
		s.ID = string(buf[extraLen : extraLen+idLen])
		s.Name = string(buf[extraLen+idLen:])
		if err := budget.add(idLen+nameLen, "snapshot table"); err != nil {
			return nil, 0, err
		}
		s.Err = checkSnapshot(&s, name, h, fileSize, cs)
		snaps = append(snaps, s)
		off += (snapshotFixedBytes + varLen + 7) &^ 7
	}
	return snaps, off - start, nil
}

// checkSnapshot says why snapshot s cannot be opened, or nil. The rules are
// those by which qemu refuses to load a snapshot (qcow2_snapshot_goto,
// qcow2_snapshot_load_tmp, and the truncation to the snapshot's size).
func checkSnapshot(s *Snapshot, file string, h *Header, fileSize, cs int64) error {
	bad := func(field string, val uint64, off int64, format string, args ...any) error {
		return &FormatError{File: file, Field: field, Value: val, Offset: off, Msg: fmt.Sprintf("snapshot %q: ", s.ID) + fmt.Sprintf(format, args...)}
	}
	switch {
	case s.L1TableOffset%uint64(cs) != 0:
		return bad("snapshot l1_table_offset", s.L1TableOffset, s.entryOff, "not aligned to the cluster size")
	case uint64(s.L1Size)*8 > maxL1Bytes:
		return bad("snapshot l1_size", uint64(s.L1Size), s.entryOff+8, "L1 table larger than %d bytes", maxL1Bytes)
	case s.L1Size > 0 && (s.L1TableOffset >= uint64(fileSize) || uint64(s.L1Size)*8 > uint64(fileSize)-s.L1TableOffset):
		return bad("snapshot l1_table_offset", s.L1TableOffset, s.entryOff, "L1 table runs past the end of the file")
	case s.Size < 0 || s.Size%512 != 0:
		// qemu: "The new size must be a multiple of 512".
		return bad("snapshot disk_size", uint64(s.Size), s.entryOff+48, "not a multiple of 512 bytes")
	case l1EntriesFor(uint64(s.Size), h) > maxL1Bytes/8:
		// qemu: "Failed to grow the L1 table: File too large".
		return bad("snapshot disk_size", uint64(s.Size), s.entryOff+48, "needs a larger L1 table than qemu allows")
	}
	return nil
}

// l1EntriesFor is the number of L1 entries a disk of size bytes needs.
func l1EntriesFor(size uint64, h *Header) uint64 {
	cs := uint64(h.ClusterSize())
	entryBytes := uint64(8)
	if h.ExtendedL2() {
		entryBytes = 16
	}
	span := cs / entryBytes * cs // guest bytes one L2 table maps
	return size/span + min(size%span, 1)
}

// Snapshots returns the image's internal snapshots, in table order.
func (img *Image) Snapshots() []Snapshot { return img.snapshots }

// findSnapshot returns the snapshot whose ID, or else name, is want.
func findSnapshot(snaps []Snapshot, want string) (*Snapshot, bool) {
	for i := range snaps {
		if snaps[i].ID == want {
			return &snaps[i], true
		}
	}
	for i := range snaps {
		if snaps[i].Name == want {
			return &snaps[i], true
		}
	}
	return nil, false
}
