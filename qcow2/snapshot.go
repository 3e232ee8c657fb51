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

// maxSnapshotExtra is qemu's limit on a snapshot's extra data.
const maxSnapshotExtra = 1024

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

	entryOff int64 // byte offset of the entry in the image file
}

// readSnapshots parses the snapshot table of the qcow2 file m, returning
// the snapshots and the table's size in bytes. Every field is checked
// against the file and the specification where it is read.
func readSnapshots(m *metaFile, h *Header) ([]Snapshot, int64, error) {
	name, fileSize := m.name(), m.size
	if h.NbSnapshots == 0 {
		return nil, 0, nil
	}
	bad := func(field string, val uint64, off int64, format string, args ...any) error {
		return &FormatError{File: name, Field: field, Value: val, Offset: off, Msg: fmt.Sprintf(format, args...)}
	}
	cs := h.ClusterSize()
	var snaps []Snapshot
	off := int64(h.SnapshotsOffset)
	var fixed [40]byte
	for i := uint32(0); i < h.NbSnapshots; i++ {
		if off+40 > fileSize {
			return nil, 0, bad("snapshot table", uint64(i), 64, "snapshot %d's entry at byte offset %d runs past the end of the file", i, off)
		}
		if err := m.read(fixed[:], off, fmt.Sprintf("snapshot %d", i)); err != nil {
			return nil, 0, err
		}
		be := binary.BigEndian
		s := Snapshot{
			L1TableOffset: be.Uint64(fixed[0:]),
			L1Size:        be.Uint32(fixed[8:]),
			DateSec:       be.Uint32(fixed[16:]),
			DateNsec:      be.Uint32(fixed[20:]),
			VMClockNsec:   be.Uint64(fixed[24:]),
			VMStateSize:   uint64(be.Uint32(fixed[32:])),
			Size:          int64(h.Size),
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
		if off+40+varLen > fileSize {
			return nil, 0, bad("snapshot entry", uint64(varLen), off, "snapshot %d's entry runs past the end of the file", i)
		}
		buf := make([]byte, varLen)
		if err := m.read(buf, off+40, fmt.Sprintf("snapshot %d", i)); err != nil {
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

		if s.Size < 0 || s.Size > 1<<62 {
			return nil, 0, bad("snapshot disk_size", uint64(s.Size), off+48, "snapshot %q: impossible virtual size", s.ID)
		}
		if s.L1TableOffset%uint64(cs) != 0 {
			return nil, 0, bad("snapshot l1_table_offset", s.L1TableOffset, off, "snapshot %q: not aligned to the cluster size", s.ID)
		}
		if uint64(s.L1Size)*8 > maxL1Bytes {
			return nil, 0, bad("snapshot l1_size", uint64(s.L1Size), off+8, "snapshot %q: L1 table larger than %d bytes", s.ID, maxL1Bytes)
		}
		if s.L1Size > 0 && (s.L1TableOffset >= uint64(fileSize) || uint64(s.L1Size)*8 > uint64(fileSize)-s.L1TableOffset) {
			return nil, 0, bad("snapshot l1_table_offset", s.L1TableOffset, off, "snapshot %q: L1 table runs past the end of the file", s.ID)
		}
		snaps = append(snaps, s)
		off += (40 + varLen + 7) &^ 7
	}
	return snaps, off - int64(h.SnapshotsOffset), nil
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
