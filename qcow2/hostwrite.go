package qcow2

import (
	"errors"
	"fmt"
	"math/bits"
	"sync"
	"syscall"
)

// The door of every host write of the writer: guest data, copy-on-write
// data and metadata go to the image and data files through the functions
// here, each checked first against the metadata map (a hit marks the image
// corrupt, as qemu does, and stops its writes); so do syncs, the header's
// writes and the files' growth. A host write or sync that fails sticks
// (writer.fail).

// growth is what the writer made of its files' sizes, guarded by w.mu.
type growth struct {
	fileEnd      int64 // the image file's size as the writer made it
	zeroFrom     int64 // clusters at or past this index read zeros on the host
	short        bool  // the host ran short of space: the growth ahead is given back at flush
	dataEnd      int64 // the data file's size (external data files)
	dataZeroFrom int64 // and its size at open, rounded up to a cluster
}

// headerSector is the first sector of the image's header as last written,
// and the buffer the next write is made in. mu serialises header writes
// (updateHeader), which markCorrupt makes without w.mu.
type headerSector struct {
	mu       sync.Mutex
	cur, buf []byte
}

// writeData writes guest data (or copy-on-write data) at host offset off
// of the data file, after checking that it is no metadata. pin is the
// caller's, held since it found off; a write left in flight (behind.go)
// holds a pin of its own until it lands.
func (w *writer) writeData(b []byte, off int64, pin Pin) error {
	if w.df == w.f {
		if err := w.checkOverlap(off, int64(len(b)), 0); err != nil {
			return err
		}
	}
	if w.l.crypt != nil {
		// Ciphertext, encrypted for where it lands (encrypt.go); the
		// write path gives whole sectors (WriteAt rounds out).
		if off%512 != 0 || len(b)%512 != 0 {
			return fmt.Errorf("%s: a write of %d bytes at host offset %d is not whole sectors", w.l.name, len(b), off)
		}
		bp := w.encrypted(b, off)
		defer putBuf(bp)
		b = (*bp)[:len(b)]
	}
	if w.writeBehind(b, off, pin) {
		return nil
	}
	w.behind.wait(off, off+int64(len(b)))
	if _, err := w.df.WriteAt(b, off); err != nil {
		return w.fail(err)
	}
	if len(b) >= writebackMin {
		if wb, ok := w.df.(writebacker); ok {
			// Advisory: a failure shows at the next fdatasync.
			_ = wb.StartWriteback(off, int64(len(b)))
		}
	}
	return nil
}

// writebackMin is the smallest data write whose range is handed to the
// disk at once (writebacker). Below it the kernel's own writeback, which
// merges small writes, does better; at and above it a guest streams data
// (a 1 MiB dd, a file copy inside the guest), and starting the disk early
// is what the guest's O_DIRECT or fsync would wait for anyway.
const writebackMin = 256 << 10

// writeMeta writes metadata of the given kind at off, after checking that
// its clusters hold only metadata of that kind (a free cluster becoming
// one is added to the map before it is written).
func (w *writer) writeMeta(b []byte, off int64, kind MetaKind) error {
	if err := w.checkOverlap(off, int64(len(b)), Kinds(kind)); err != nil {
		return err
	}
	if _, err := w.f.WriteAt(b, off); err != nil {
		return w.fail(err)
	}
	return nil
}

// writeTable writes the dirty part of a cached table back to its cluster,
// whole sectors at a time.
func (w *writer) writeTable(e *cacheEntry, kind MetaKind) error {
	if err := w.writeWords(e.table, e.key.off, kind); err != nil {
		return err
	}
	w.st.tablesFlushed.Add(1)
	return nil
}

// writeWords writes words [dirtyLo, dirtyHi) of t, rounded out to whole
// 512-byte sectors, to the table at off, and marks t clean.
func (w *writer) writeWords(t *table, off int64, kind MetaKind) error {
	if t.dirtyLo >= t.dirtyHi {
		return nil
	}
	lo := t.dirtyLo &^ 63 // 64 words to a sector
	hi := min((t.dirtyHi+63)&^63, len(t.words))
	buf := w.tableBuf(hi - lo)
	for i := lo; i < hi; i++ {
		putWord(buf[(i-lo)*8:], t.word(int64(i)))
	}
	if err := w.writeMeta(buf, off+int64(lo)*8, kind); err != nil {
		return err
	}
	t.dirtyLo, t.dirtyHi = 0, 0
	return nil
}

// tableBuf returns a buffer of n words' bytes, reused between writes.
func (w *writer) tableBuf(n int) []byte {
	if cap(w.dirty.writeBuf) < n*8 {
		w.dirty.writeBuf = make([]byte, n*8)
	}
	return w.dirty.writeBuf[:n*8]
}

// checkOverlap fails, marks the image corrupt (as qemu does) and stops all
// writes if a cluster of [off, off+n) of the image file holds metadata of
// a kind not in allowed.
func (w *writer) checkOverlap(off, n int64, allowed MetaKinds) error {
	return w.checkClusters("a write of", off, n, allowed)
}

// checkClusters is checkOverlap for any change of a host range: what says
// what the change is ("a write of", "freeing", "punching").
func (w *writer) checkClusters(what string, off, n int64, allowed MetaKinds) error {
	m := w.l.metaMap.Load()
	r, bad := m.conflict(off, off+n, allowed)
	if !bad {
		return nil
	}
	err := &FormatError{File: w.l.name, Field: "host offset", Value: uint64(off), Offset: -1,
		Msg: fmt.Sprintf("%s %d bytes at %#x would change the %s in cluster %#x: the image is corrupt; it is marked so and no longer written", what, n, off, r.Kinds, r.Start)}
	w.markCorrupt(err)
	return fmt.Errorf("%w: %w", ErrOverlap, err)
}

// markCorrupt sets the header's corrupt bit, as qemu does on an overlap,
// and stops every later write.
func (w *writer) markCorrupt(why error) {
	if !w.corrupt.CompareAndSwap(nil, &why) {
		return
	}
	// Best effort: the image is refused from now on whatever the header
	// says, and a failed write here changes nothing else.
	_ = w.updateHeader(func(h []byte) {
		fieldIncompatibleFeatures.put(h, fieldIncompatibleFeatures.get(h)|IncompatCorrupt)
	})
}

// addMeta records new metadata in the map, before it is written.
func (w *writer) addMeta(off, n int64, k MetaKind) error {
	m := w.l.metaMap.Load()
	if r, bad := m.conflict(off, off+n, 0); bad {
		err := &FormatError{File: w.l.name, Field: "host offset", Value: uint64(off), Offset: -1,
			Msg: fmt.Sprintf("a new %s at %#x would overlap the %s in cluster %#x: the image is corrupt; it is marked so and no longer written", k, off, r.Kinds, r.Start)}
		w.markCorrupt(err)
		return fmt.Errorf("%w: %w", ErrOverlap, err)
	}
	w.l.metaMap.Store(m.with(off, off+n, k))
	return nil
}

// sync makes what was written to the image file durable.
func (w *writer) sync() error {
	w.st.syncs.Add(1)
	if err := w.f.Sync(); err != nil {
		return w.fail(err)
	}
	return nil
}

// syncAll syncs the data file too, if there is one, once the data
// writes in flight have landed.
func (w *writer) syncAll() error {
	w.behind.drain()
	if err := w.usable(); err != nil {
		return err
	}
	if w.df != w.f {
		w.st.syncs.Add(1)
		if err := w.df.Sync(); err != nil {
			return w.fail(err)
		}
	}
	return w.sync()
}

// updateHeader changes fields of the header's first sector and writes it
// with one synced write: every field the writer switches (L1 table,
// refcount table, size, features) lies in it, so each switch is atomic.
// change gets the header as it is now, never a copy taken before an
// allocation that may have switched a table meanwhile (a resize whose L1
// allocation grew the refcount table must not put the old table back).
// Header writes are serialised by hdrMu, which markCorrupt takes too.
func (w *writer) updateHeader(change func(h []byte)) error {
	w.hdr.mu.Lock()
	defer w.hdr.mu.Unlock()
	h := w.hdr.buf[:len(w.hdr.cur)]
	copy(h, w.hdr.cur)
	change(h)
	if _, err := w.f.WriteAt(h, 0); err != nil {
		return w.fail(err)
	}
	w.st.syncs.Add(1)
	if err := w.f.Sync(); err != nil {
		return w.fail(err)
	}
	copy(w.hdr.cur, h)
	return nil
}

// headerField returns a field of the header as last written.
func (w *writer) headerField(f headerField) uint64 {
	w.hdr.mu.Lock()
	defer w.hdr.mu.Unlock()
	return f.get(w.hdr.cur)
}

func putWord(b []byte, v uint64) {
	_ = b[7]
	b[0], b[1], b[2], b[3] = byte(v>>56), byte(v>>48), byte(v>>40), byte(v>>32)
	b[4], b[5], b[6], b[7] = byte(v>>24), byte(v>>16), byte(v>>8), byte(v)
}

// Buffers for assembled writes, by power-of-two size class from 4 KiB.
var bufPools [24]sync.Pool

func bufClass(n int) int {
	if n <= 4096 {
		return 0
	}
	return bits.Len(uint(n-1)) - 12
}

func getBuf(n int) *[]byte {
	c := bufClass(n)
	if c >= len(bufPools) {
		b := make([]byte, n)
		return &b
	}
	if bp, ok := bufPools[c].Get().(*[]byte); ok {
		return bp
	}
	b := make([]byte, 4096<<c)
	return &b
}

func putBuf(bp *[]byte) {
	c := bufClass(cap(*bp))
	if c < len(bufPools) && cap(*bp) == 4096<<c {
		bufPools[c].Put(bp)
	}
}

// growStep is how far ahead of the allocations the image file is grown.
const growStep = 32 << 20

// reserveFile makes sure the image file reaches at least size bytes,
// growing it ahead in large steps. The step ahead is a hint: on a host
// file system short of space it falls back to half the step, and so on
// down to exactly size, so that a write fails with ENOSPC only when the
// host cannot take that write (qemu-io's would fail then too); a file
// reserved short is given back to its end at the next flush. A failure
// here has written nothing, so it is not sticky: once space is freed, the
// next write goes through.
func (w *writer) reserveFile(size int64) error {
	if size <= w.growth.fileEnd {
		return nil
	}
	target := (size + growStep - 1) / growStep * growStep
	for {
		err := w.f.Allocate(w.growth.fileEnd, target-w.growth.fileEnd)
		if err == nil {
			break
		}
		if unsupported(err) {
			// A file system without fallocate: the writes will grow
			// the file themselves.
			target = size
			break
		}
		if !errors.Is(err, syscall.ENOSPC) || target == size {
			return err
		}
		w.growth.short = true
		ahead := (target - size) / 2 &^ (w.l.clusterSize() - 1) // 0: exactly size
		target = size + ahead
	}
	w.growth.fileEnd = target
	w.l.setFileSize(target)
	return nil
}

// giveBack truncates the image file to the end of the clusters in use (or
// its size at open, if larger), giving back what reserveFile took ahead.
// Only clusters no refcount (in memory) counts are cut, so it is safe even
// on an image that stopped taking writes.
func (w *writer) giveBack() {
	cs := w.l.clusterSize()
	if end := max(w.alloc.end*cs, w.growth.zeroFrom*cs); end < w.growth.fileEnd {
		if err := w.f.Truncate(end); err == nil {
			w.growth.fileEnd = end
			w.l.setFileSize(end)
		}
	}
	w.growth.short = false
}

// unsupported reports whether err says the file system cannot do what was
// asked (fallocate, punch), rather than that it failed doing it.
func unsupported(err error) bool {
	return errors.Is(err, syscall.EOPNOTSUPP) || errors.Is(err, syscall.ENOSYS) || errors.Is(err, syscall.EINVAL)
}

// growDataFile makes an external data file as large as the disk, so that
// every guest offset lies inside it (a raw data file is a raw image of the
// disk). The caller holds w.mu.
func (w *writer) growDataFile() error {
	l := w.l
	if !l.external() || w.growth.dataEnd >= l.vsize() {
		return nil
	}
	if err := w.df.Truncate(l.vsize()); err != nil {
		return w.fail(err)
	}
	w.growth.dataEnd = l.vsize()
	l.dataLen.Store(w.growth.dataEnd)
	return nil
}

// zeroDataFile makes [off, off+n) of the external data file read zeros,
// after any write in flight there: punched, or where the file system
// cannot punch, written with zeros.
func (w *writer) zeroDataFile(off, n int64) error {
	w.behind.wait(off, off+n)
	err := w.df.Punch(off, n)
	if err == nil {
		return nil
	}
	if !unsupported(err) {
		return w.fail(err)
	}
	for pos := off; pos < off+n; pos += int64(len(zeroes)) {
		if _, err := w.df.WriteAt(zeroes[:min(off+n-pos, int64(len(zeroes)))], pos); err != nil {
			return w.fail(err)
		}
	}
	return nil
}
