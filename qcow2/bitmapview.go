package qcow2

import (
	"encoding/binary"
	"fmt"
	"math/bits"
	"sync/atomic"
)

// Reading a persistent bitmap: which guest ranges it says changed, for
// `qcowfs map --bitmap` and the changed-blocks view of a mount. A bitmap
// the writer keeps (bitmapwrite.go) is read live, as the writes set it;
// any other is read from the image file when the view is made. A bitmap
// in use that this process is not writing is inconsistent, and refused, as
// qemu-nbd -B refuses it.

// BitmapView is one bitmap's dirty ranges. It is safe for concurrent use.
// A live view follows the writer as it grows the disk: its size and bits
// are the writer's at each call.
type BitmapView struct {
	Name        string
	Granularity int64
	size        func() int64           // the disk's size
	words       func() []atomic.Uint64 // the bits, granule by granule
	release     func()
}

// BitmapView returns a view of the persistent bitmap name. Close it when
// done.
func (img *Image) BitmapView(name string) (*BitmapView, error) {
	l := img.top
	if w := img.w; w != nil {
		w.mu.Lock()
		defer w.mu.Unlock()
		for _, tb := range w.bitmaps.tracked {
			if tb.entry.name == name {
				return &BitmapView{Name: name, Granularity: 1 << tb.entry.granBits, size: l.vsize,
					words: func() []atomic.Uint64 { return *tb.bits.Load() }, release: func() {}}, nil
			}
		}
	}
	if !l.bitmapsUsed() {
		return nil, fmt.Errorf("%s: bitmap %q: %w (the image has no valid bitmaps)", l.name, name, ErrNoBitmap)
	}
	dir, err := l.readBitmapDirectory()
	if err != nil {
		return nil, err
	}
	for i := range dir {
		e := &dir[i]
		if e.name != name {
			continue
		}
		if e.flags&bitmapInUse != 0 {
			return nil, fmt.Errorf("%s: bitmap %q is in use: it is inconsistent (a program writing the image did not close it cleanly)", l.name, name)
		}
		return l.loadBitmapView(e)
	}
	return nil, fmt.Errorf("%s: bitmap %q: %w", l.name, name, ErrNoBitmap)
}

// loadBitmapView reads bitmap e from the file.
func (l *layer) loadBitmapView(e *bitmapEntry) (*BitmapView, error) {
	table, err := l.readBitmapTable(e)
	if err != nil {
		return nil, err
	}
	defer l.budget.sub(int64(len(table)) * 8)
	n := bitmapWords(l.vsize(), e.granBits)
	if err := l.budget.add(n*8, fmt.Sprintf("bitmap %q", e.name)); err != nil {
		return nil, err
	}
	size, all := l.vsize(), make([]atomic.Uint64, n)
	v := &BitmapView{Name: e.name, Granularity: 1 << e.granBits, size: func() int64 { return size },
		words: func() []atomic.Uint64 { return all }, release: func() { l.budget.sub(n * 8) }}
	if err := l.readBitmapWords(e, table, all); err != nil {
		v.release()
		return nil, err
	}
	return v, nil
}

// readBitmapWords reads the data clusters of bitmap e, whose table is
// table, into words (as many as the disk needs, or more): an entry 1
// sets its cluster's bits, 0 leaves them clear.
func (l *layer) readBitmapWords(e *bitmapEntry, table []uint64, words []atomic.Uint64) error {
	cs := l.clusterSize()
	perCluster := cs / 8
	buf := make([]byte, cs)
	for j, te := range table {
		first := int64(j) * perCluster
		if first >= int64(len(words)) {
			break
		}
		part := words[first:min(int64(len(words)), first+perCluster)]
		switch off := int64(te & bitmapEntryMask); {
		case off != 0:
			if err := l.meta.read(buf, off, fmt.Sprintf("bitmap %q data", e.name)); err != nil {
				return err
			}
			for i := range part {
				part[i].Store(binary.LittleEndian.Uint64(buf[8*i:]))
			}
		case te&1 != 0:
			for i := range part {
				part[i].Store(^uint64(0))
			}
		}
	}
	return nil
}

// Close gives the view's memory back.
func (v *BitmapView) Close() { v.release() }

// Size is the disk's size the view covers.
func (v *BitmapView) Size() int64 { return v.size() }

// next returns the first offset at or after off in a granule whose bit is
// set (dirty) or clear, or the size if there is none.
func (v *BitmapView) next(off int64, dirty bool) int64 {
	size, words := v.size(), v.words() // (a grow replaces the bits before the size)
	if off >= size {
		return size
	}
	g := int64(bits.TrailingZeros64(uint64(v.Granularity)))
	i := off >> g
	for w := i / 64; w < int64(len(words)); w++ {
		word := words[w].Load()
		if !dirty {
			word = ^word
		}
		if w == i/64 {
			word &^= uint64(1)<<(i%64) - 1
		}
		if word != 0 {
			at := (w*64 + int64(bits.TrailingZeros64(word))) << g
			return min(max(at, off), size)
		}
	}
	return size
}

// NextDirty returns the first offset at or after off that the bitmap says
// changed, or Size if none.
func (v *BitmapView) NextDirty(off int64) int64 { return v.next(off, true) }

// NextClean returns the first offset at or after off that the bitmap says
// did not change, or Size if none.
func (v *BitmapView) NextClean(off int64) int64 { return v.next(off, false) }
