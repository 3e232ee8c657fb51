package qcow2

import "context"

// MapEntry is one extent as `qemu-img map --output=json` prints it.
type MapEntry struct {
	Start      int64  `json:"start"`
	Length     int64  `json:"length"`
	Depth      int    `json:"depth"`
	Present    bool   `json:"present"`
	Zero       bool   `json:"zero"`
	Data       bool   `json:"data"`
	Compressed bool   `json:"compressed"`
	Offset     *int64 `json:"offset,omitempty"`
	// File is the host file Offset refers to ("" without Offset); qemu
	// prints it in its human format only.
	File string `json:"-"`
}

// mergeable tells whether next continues e, by qemu-img's rule: same
// status, depth and file, and contiguous host offsets where there are any.
func (e *MapEntry) mergeable(next *MapEntry) bool {
	if e.Zero != next.Zero || e.Data != next.Data || e.Compressed != next.Compressed ||
		e.Depth != next.Depth || e.Present != next.Present || e.File != next.File ||
		(e.Offset == nil) != (next.Offset == nil) {
		return false
	}
	return e.Offset == nil || *e.Offset+e.Length == *next.Offset
}

// Map calls fn with the image's map, extent by extent, merged the way
// qemu-img map merges them, from offset 0 to the end of the disk, stopping
// with ctx's error when ctx is done. Its work is what its output is, and
// no more: in an image without a backing file, an L2 table's entries
// depend on the table alone, so a table that many L1 entries name is
// looked up once and its entries repeated (at most maxMapMemo of them
// kept).
func (img *Image) Map(ctx context.Context, fn func(MapEntry) error) error {
	l := img.top
	size := img.Size()
	var cur MapEntry
	emit := func(next MapEntry) error {
		if cur.Length > 0 && cur.mergeable(&next) {
			cur.Length += next.Length
			return nil
		}
		if cur.Length > 0 {
			if err := fn(cur); err != nil {
				return err
			}
		}
		cur = next
		return nil
	}
	memo := !l.raw && l.backing == nil
	var span int64
	if memo {
		span = l.clusterSize() << l.l2Bits
	}
	tables := map[int64][]MapEntry{} // L2 table offset -> its entries, relative to its span
	held, n := 0, 0
	for off := int64(0); off < size; {
		if n++; n&1023 == 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		var l2 int64
		if memo && off%span == 0 && off+span <= size {
			if t := l.l1.Load(); off/span < t.len() {
				l2 = t.entry(off / span).l2Offset()
			}
		}
		if ps, ok := tables[l2]; ok && l2 != 0 {
			for _, p := range ps {
				p.Start += off
				if p.Offset != nil {
					o := *p.Offset
					p.Offset = &o
				}
				if err := emit(p); err != nil {
					return err
				}
			}
			off += span
			continue
		}
		end := size
		if l2 != 0 {
			end = off + span
		}
		var ps []MapEntry
		for spanStart := off; off < end; {
			e, err := img.Extent(off, end-off)
			if err != nil {
				return err
			}
			next := mapEntry(&e)
			if l2 != 0 {
				rel := next
				rel.Start -= spanStart
				ps = append(ps, rel)
			}
			if err := emit(next); err != nil {
				return err
			}
			off += e.Length
			if l2 == 0 {
				break
			}
		}
		if l2 != 0 && held+len(ps) <= maxMapMemo {
			tables[l2] = ps
			held += len(ps)
		}
	}
	if cur.Length > 0 {
		return fn(cur)
	}
	return nil
}

// maxMapMemo bounds the entries Map keeps for tables named again.
const maxMapMemo = 1 << 20

// mapEntry is the MapEntry of one extent.
func mapEntry(e *Extent) MapEntry {
	m := MapEntry{
		Start:      e.Start,
		Length:     e.Length,
		Depth:      e.Depth,
		Present:    e.Status&StatusAllocated != 0,
		Zero:       e.Status&StatusZero != 0,
		Data:       e.Status&StatusData != 0,
		Compressed: e.Status&StatusCompressed != 0,
	}
	// qemu gives no offset for an encrypted layer's data (qcow2.c,
	// qcow2_co_block_status: only without s->crypto), which holds
	// ciphertext there.
	if e.Offset >= 0 && (e.layer == nil || e.layer.crypt == nil) {
		o := e.Offset
		m.Offset = &o
		m.File = e.HostFile()
	}
	return m
}
