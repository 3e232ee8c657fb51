package qemuimg

import "github.com/qcowfs/qcowfs/qcow2"

// DirtyRanges is a persistent bitmap's answer to "what changed": a
// *qcow2.BitmapView.
type DirtyRanges interface {
	NextDirty(off int64) int64 // the first dirty offset at or after off, or Size
	NextClean(off int64) int64 // the first clean offset at or after off, or Size
	Size() int64
}

// BitmapMap walks the dirty ranges of a persistent bitmap as qemu-img map
// reports them through qemu-nbd -B NAME and the NBD client's
// x-dirty-bitmap=qemu:dirty-bitmap:NAME, which is how backup tools read
// them: the client reports a dirty range as a hole (not present, no data,
// no offset) and a clean one as data at its own offset (the export is the
// disk itself). So the JSON form's entries with "data": false are the
// dirty ranges, and the human form, which lists data, lists the clean
// ones. qemu names the NBD export as the file; file stands in for it.
func BitmapMap(v DirtyRanges, file string, fn func(qcow2.MapEntry) error) error {
	size := v.Size()
	for off := int64(0); off < size; {
		e := qcow2.MapEntry{Start: off}
		if dirty := v.NextDirty(off); dirty > off {
			at := off
			e.Length, e.Present, e.Data, e.Offset, e.File = dirty-off, true, true, &at, file
		} else {
			e.Length = v.NextClean(off) - off
		}
		if err := fn(e); err != nil {
			return err
		}
		off += e.Length
	}
	return nil
}
