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
// qemu-img map merges them, from offset 0 to the end of the disk.
func (img *Image) Map(fn func(MapEntry) error) error {
	return img.MapContext(context.Background(), fn)
}

// MapContext is Map, stopping with ctx's error when ctx is done. Its work
// is what its output is: one extent lookup per entry before merging.
func (img *Image) MapContext(ctx context.Context, fn func(MapEntry) error) error {
	var cur MapEntry
	for n, off := 0, int64(0); off < img.Size(); n++ {
		if n&1023 == 1023 {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		e, err := img.Extent(off, img.Size()-off)
		if err != nil {
			return err
		}
		next := MapEntry{
			Start:      e.Start,
			Length:     e.Length,
			Depth:      e.Depth,
			Present:    e.Status&StatusAllocated != 0,
			Zero:       e.Status&StatusZero != 0,
			Data:       e.Status&StatusData != 0,
			Compressed: e.Status&StatusCompressed != 0,
		}
		if e.Offset >= 0 {
			o := e.Offset
			next.Offset = &o
			next.File = e.HostFile()
		}
		switch {
		case cur.Length > 0 && cur.mergeable(&next):
			cur.Length += next.Length
		default:
			if cur.Length > 0 {
				if err := fn(cur); err != nil {
					return err
				}
			}
			cur = next
		}
		off += e.Length
	}
	if cur.Length > 0 {
		return fn(cur)
	}
	return nil
}
