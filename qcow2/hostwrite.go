package qcow2

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
)

// The door of every host write of the writer: guest data, copy-on-write
// data and metadata go to the image and data files through hostDoor, each
// write checked first against the metadata map (a hit marks the image
// corrupt, as qemu does, and stops its writes); so do syncs, punches, the
// header's writes and the files' growth. A host write or sync that fails
// sticks (fail).

// hostDoor is the writer's door to its host files. It owns what the
// writer made of them: their sizes and growth, which clusters read zeros,
// the header's first sector as last written, and whether a write failed
// (failed) or found the image corrupt (corrupt).
//
// Its sizes, punch record and buffer are guarded by the writer's mutex
// (w.mu). Data writes, the overlap checks and markCorrupt run without it
// too (in-place writes): they touch only the files, the layer's metadata
// map (atomic), failed and corrupt (atomic) and the header, whose writes
// hdr.mu serialises.
type hostDoor struct {
	l      *layer
	f      WritableFile // the image file
	df     WritableFile // where data clusters live: the external data file, or f
	behind *behind      // data writes in flight (behind.go)
	st     *writeCounters

	fileEnd      int64          // the image file's size as the writer made it
	zeroFrom     int64          // clusters at or past this index read zeros on the host
	short        bool           // the host ran short of space: the growth ahead is given back at flush
	dataEnd      int64          // the data file's size (external data files)
	dataZeroFrom int64          // and its size at open, rounded up to a cluster
	zeroed       map[int64]bool // clusters punched when freed: they read zeros
	buf          []byte         // where tables are encoded to be written (writeWords)

	hdr headerSector

	// failed is sticky: a host write or sync failed, and every later
	// flush fails. corrupt: an overlap was found, and no more writes are
	// made at all.
	failed  atomic.Pointer[error]
	corrupt atomic.Pointer[error]
}

// headerSector is the first sector of the image's header as last written,
// and the buffer the next write is made in. mu serialises header writes
// (updateHeader), which markCorrupt makes without w.mu.
type headerSector struct {
	mu       sync.Mutex
	cur, buf []byte
}

// newHostDoor opens the door to layer l's image file f and data file df
// (nil without one), reading the header's first sector.
func newHostDoor(l *layer, f, df WritableFile, b *behind, st *writeCounters) (*hostDoor, error) {
	d := &hostDoor{l: l, f: f, df: f, behind: b, st: st}
	cs := l.clusterSize()
	if df != nil {
		d.df = df
		d.dataEnd = l.dataLen.Load()
		d.dataZeroFrom = (d.dataEnd + cs - 1) &^ (cs - 1)
	}
	d.hdr.cur, d.hdr.buf = make([]byte, 512), make([]byte, 512)
	if err := readFull(f, d.hdr.cur[:min(512, l.fsize())], 0, "header"); err != nil {
		return nil, err
	}
	d.fileEnd = l.fsize()
	d.zeroFrom = (l.fsize() + cs - 1) / cs
	return d, nil
}

// usable fails if the image can take no more writes.
func (d *hostDoor) usable() error {
	if e := d.corrupt.Load(); e != nil {
		return *e
	}
	if e := d.failed.Load(); e != nil {
		return *e
	}
	return nil
}

// fail records a host I/O error: it sticks, so that every later flush of
// the image fails too, and no acknowledged write is silently lost.
func (d *hostDoor) fail(err error) error {
	sticky := fmt.Errorf("%s: an earlier write or sync failed, so writes since the last successful flush may be lost: %w", d.l.name, err)
	d.failed.CompareAndSwap(nil, &sticky)
	return err
}

// writeData writes guest data (or copy-on-write data) at host offset off
// of the data file, after checking that it is no metadata, and after any
// write in flight there. pin is the caller's, held since it found off; a
// write left in flight (writeBehind) holds a pin of its own until it
// lands.
func (d *hostDoor) writeData(b []byte, off int64, pin Pin) error {
	if d.df == d.f {
		if err := d.checkOverlap(off, int64(len(b)), 0); err != nil {
			return err
		}
	}
	if lc := d.l.crypt; lc != nil {
		// Ciphertext, encrypted for where it lands (encrypt.go); the
		// write path gives whole sectors (WriteAt rounds out).
		if off%512 != 0 || len(b)%512 != 0 {
			return fmt.Errorf("%s: a write of %d bytes at host offset %d is not whole sectors", d.l.name, len(b), off)
		}
		bp := lc.encrypted(b, off)
		defer putBuf(bp)
		b = (*bp)[:len(b)]
	}
	if d.writeBehind(b, off, pin) {
		return nil
	}
	d.behind.wait(off, off+int64(len(b)))
	if _, err := d.df.WriteAt(b, off); err != nil {
		return d.fail(err)
	}
	if len(b) >= writebackMin {
		if wb, ok := d.df.(writebacker); ok {
			// Advisory: a failure shows at the next fdatasync.
			_ = wb.StartWriteback(off, int64(len(b)))
		}
	}
	return nil
}

// writeBehind leaves the write of b at off in flight (behind.go), and
// reports whether it did (else the caller writes b now). A write large and
// aligned enough for O_DIRECT (direct.go) goes so; so does a small one
// while others are in flight (the tail of a guest's 1 MiB write, which
// FUSE sends as a request of its own): it would wait for the file's lock
// behind them anyway, and the guest for it.
//
// It returns once b is copied and queued; the write lands on a goroutine
// of its own, holding a pin of pin's. The copy is needed anyway for
// O_DIRECT: a FUSE request's payload is not aligned in memory (it starts 80
// bytes into go-fuse's buffer), and it is reused once the request is
// answered. It is one copy into a warm buffer, instead of one into new
// page-cache pages. A failure sticks like any other (fail).
func (d *hostDoor) writeBehind(b []byte, off int64, pin Pin) bool {
	dw, direct := directFor(d.df, b, off)
	if !direct && (len(b) > behindSmall || d.behind.idle()) {
		return false
	}
	bp := getBuf(len(b))
	buf := (*bp)[:len(b)]
	if direct && !aligned(buf) {
		putBuf(bp)
		return false
	}
	end := off + int64(len(b))
	d.behind.add(off, end)
	copy(buf, b)
	if direct {
		d.st.directBytes.Add(int64(len(b)))
	}
	held := pin.dup()
	go func() {
		var err error
		if direct {
			err = dw.WriteDirect(buf, off)
		} else {
			_, err = d.df.WriteAt(buf, off)
		}
		if err != nil {
			d.fail(err)
		}
		putBuf(bp)
		held.Release()
		d.behind.done(off, end)
	}()
	return true
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
func (d *hostDoor) writeMeta(b []byte, off int64, kind MetaKind) error {
	if err := d.checkOverlap(off, int64(len(b)), Kinds(kind)); err != nil {
		return err
	}
	if _, err := d.f.WriteAt(b, off); err != nil {
		return d.fail(err)
	}
	return nil
}

// writeTable writes the dirty part of a cached table back to its cluster,
// whole sectors at a time.
func (d *hostDoor) writeTable(e *cacheEntry, kind MetaKind) error {
	if err := d.writeWords(e.table, e.key.off, kind); err != nil {
		return err
	}
	d.st.tablesFlushed.Add(1)
	return nil
}

// writeWords writes words [dirtyLo, dirtyHi) of t, rounded out to whole
// 512-byte sectors, to the table at off, and marks t clean.
func (d *hostDoor) writeWords(t *table, off int64, kind MetaKind) error {
	if t.dirtyLo >= t.dirtyHi {
		return nil
	}
	lo := t.dirtyLo &^ 63 // 64 words to a sector
	hi := min((t.dirtyHi+63)&^63, len(t.words))
	buf := d.tableBuf(hi - lo)
	for i := lo; i < hi; i++ {
		putWord(buf[(i-lo)*8:], t.word(int64(i)))
	}
	if err := d.writeMeta(buf, off+int64(lo)*8, kind); err != nil {
		return err
	}
	t.dirtyLo, t.dirtyHi = 0, 0
	return nil
}

// tableBuf returns a buffer of n words' bytes, reused between writes.
func (d *hostDoor) tableBuf(n int) []byte {
	if cap(d.buf) < n*8 {
		d.buf = make([]byte, n*8)
	}
	return d.buf[:n*8]
}

// checkOverlap fails, marks the image corrupt (as qemu does) and stops all
// writes if a cluster of [off, off+n) of the image file holds metadata of
// a kind not in allowed.
func (d *hostDoor) checkOverlap(off, n int64, allowed MetaKinds) error {
	return d.checkClusters("a write of", off, n, allowed)
}

// checkClusters is checkOverlap for any change of a host range: what says
// what the change is ("a write of", "freeing", "punching").
func (d *hostDoor) checkClusters(what string, off, n int64, allowed MetaKinds) error {
	m := d.l.metaMap.Load()
	r, bad := m.conflict(off, off+n, allowed)
	if !bad {
		return nil
	}
	err := &FormatError{File: d.l.name, Field: "host offset", Value: uint64(off), Offset: -1,
		Msg: fmt.Sprintf("%s %d bytes at %#x would change the %s in cluster %#x: the image is corrupt; it is marked so and no longer written", what, n, off, r.Kinds, r.Start)}
	d.markCorrupt(err)
	return fmt.Errorf("%w: %w", ErrOverlap, err)
}

// markCorrupt sets the header's corrupt bit, as qemu does on an overlap,
// and stops every later write.
func (d *hostDoor) markCorrupt(why error) {
	if !d.corrupt.CompareAndSwap(nil, &why) {
		return
	}
	// Best effort: the image is refused from now on whatever the header
	// says, and a failed write here changes nothing else.
	_ = d.updateHeader(func(h []byte) {
		fieldIncompatibleFeatures.put(h, fieldIncompatibleFeatures.get(h)|IncompatCorrupt)
	})
}

// addMeta records new metadata in the map, before it is written.
func (d *hostDoor) addMeta(off, n int64, k MetaKind) error {
	m := d.l.metaMap.Load()
	if r, bad := m.conflict(off, off+n, 0); bad {
		err := &FormatError{File: d.l.name, Field: "host offset", Value: uint64(off), Offset: -1,
			Msg: fmt.Sprintf("a new %s at %#x would overlap the %s in cluster %#x: the image is corrupt; it is marked so and no longer written", k, off, r.Kinds, r.Start)}
		d.markCorrupt(err)
		return fmt.Errorf("%w: %w", ErrOverlap, err)
	}
	d.l.metaMap.Store(m.with(off, off+n, k))
	return nil
}

// dropMeta records that [off, off+n) holds no metadata of kind k any
// more (a table freed: nothing writes it again).
func (d *hostDoor) dropMeta(off, n int64, k MetaKind) {
	d.l.metaMap.Store(d.l.metaMap.Load().without(off, off+n, k))
}

// sync makes what was written to the image file durable.
func (d *hostDoor) sync() error {
	d.st.syncs.Add(1)
	if err := d.f.Sync(); err != nil {
		return d.fail(err)
	}
	return nil
}

// syncAll syncs the data file too, if there is one, once the data
// writes in flight have landed.
func (d *hostDoor) syncAll() error {
	d.behind.drain()
	if err := d.usable(); err != nil {
		return err
	}
	if d.df != d.f {
		d.st.syncs.Add(1)
		if err := d.df.Sync(); err != nil {
			return d.fail(err)
		}
	}
	return d.sync()
}

// updateHeader changes fields of the header's first sector and writes it
// with one synced write: every field the writer switches (L1 table,
// refcount table, size, features) lies in it, so each switch is atomic.
// change gets the header as it is now, never a copy taken before an
// allocation that may have switched a table meanwhile (a resize whose L1
// allocation grew the refcount table must not put the old table back).
// Header writes are serialised by hdr.mu, which markCorrupt takes too.
func (d *hostDoor) updateHeader(change func(h []byte)) error {
	d.hdr.mu.Lock()
	defer d.hdr.mu.Unlock()
	h := d.hdr.buf[:len(d.hdr.cur)]
	copy(h, d.hdr.cur)
	change(h)
	if _, err := d.f.WriteAt(h, 0); err != nil {
		return d.fail(err)
	}
	d.st.syncs.Add(1)
	if err := d.f.Sync(); err != nil {
		return d.fail(err)
	}
	copy(d.hdr.cur, h)
	return nil
}

// headerField returns a field of the header as last written.
func (d *hostDoor) headerField(f headerField) uint64 {
	d.hdr.mu.Lock()
	defer d.hdr.mu.Unlock()
	return f.get(d.hdr.cur)
}

// growStep is how far ahead of the allocations the image file is grown.
const growStep = 32 << 20

// reserveFile makes sure the image file reaches at least size bytes,
// growing it ahead in large steps. The allocator calls it under w.mu
// before it hands out clusters past the old end, so that the growth comes
// before any write into the grown range (those come after the allocation
// returned). The step ahead is a hint: on a host
// file system short of space it falls back to half the step, and so on
// down to exactly size, so that a write fails with ENOSPC only when the
// host cannot take that write (qemu-io's would fail then too); a file
// reserved short is given back to its end at the next flush. A failure
// here has written nothing, so it is not sticky: once space is freed, the
// next write goes through.
func (d *hostDoor) reserveFile(size int64) error {
	if size <= d.fileEnd {
		return nil
	}
	target := (size + growStep - 1) / growStep * growStep
	for {
		err := d.f.Allocate(d.fileEnd, target-d.fileEnd)
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
		d.short = true
		ahead := (target - size) / 2 &^ (d.l.clusterSize() - 1) // 0: exactly size
		target = size + ahead
	}
	d.fileEnd = target
	d.l.setFileSize(target)
	return nil
}

// giveBack truncates the image file to its size at open (rounded up to a
// cluster) or to cluster used, the first past those the writer gave a
// refcount (allocator.usedEnd), if larger, giving back what reserveFile
// took ahead. Only clusters the writer reserved and never counted are cut,
// so it is safe even on an image that stopped taking writes; and
// refcounts a damaged image claims past its end do not grow it.
func (d *hostDoor) giveBack(used int64) {
	cs := d.l.clusterSize()
	if end := max(used*cs, d.zeroFrom*cs); end < d.fileEnd {
		if err := d.f.Truncate(end); err == nil {
			d.fileEnd = end
			d.l.setFileSize(end)
		}
	}
	d.short = false
}

// size is the image file's size as the writer made it.
func (d *hostDoor) size() int64 { return d.fileEnd }

// ranShort reports whether the host ran short of space since the last
// giveBack: the file is then given back to its end at the next flush.
func (d *hostDoor) ranShort() bool { return d.short }

// unsupported reports whether err says the file system cannot do what was
// asked (fallocate, punch), rather than that it failed doing it.
func unsupported(err error) bool {
	return errors.Is(err, syscall.EOPNOTSUPP) || errors.Is(err, syscall.ENOSYS) || errors.Is(err, syscall.EINVAL)
}

// growDataFile makes an external data file as large as the disk, so that
// every guest offset lies inside it (a raw data file is a raw image of the
// disk). The caller holds w.mu.
func (d *hostDoor) growDataFile() error {
	l := d.l
	if !l.external() || d.dataEnd >= l.vsize() {
		return nil
	}
	if err := d.df.Truncate(l.vsize()); err != nil {
		return d.fail(err)
	}
	d.dataEnd = l.vsize()
	l.dataLen.Store(d.dataEnd)
	return nil
}

// dataWritten records that the external data file reaches end now (a
// write into a cluster past its size).
func (d *hostDoor) dataWritten(end int64) {
	d.dataEnd = max(d.dataEnd, end)
	d.l.dataLen.Store(max(d.l.dataLen.Load(), d.dataEnd))
}

// dataReadsZero reports whether host offset off of the external data file
// reads zeros until written: it lies past the file's size at open (the
// file grew with truncate since, or never reached it).
func (d *hostDoor) dataReadsZero(off int64) bool { return off >= d.dataZeroFrom }

// clusterReadsZero reports whether host cluster c of the image file reads zeros:
// it lies past the file's end at open, or was punched when it was freed.
// The cluster is about to be written (it was just allocated): a punch is
// remembered only until then.
func (d *hostDoor) clusterReadsZero(c int64) bool {
	z := c >= d.zeroFrom || d.zeroed[c]
	delete(d.zeroed, c)
	return z
}

// punch gives host cluster c of the image file back to the host file
// system, so that it reads zeros, unless it holds metadata (checked
// first: then the image is corrupt). A file system that cannot punch
// keeps the cluster's old bytes (and copy-on-write writes its zeros).
func (d *hostDoor) punch(c int64) error {
	cs := d.l.clusterSize()
	if err := d.checkClusters("punching", c*cs, cs, 0); err != nil {
		return err
	}
	switch err := d.f.Punch(c*cs, cs); {
	case err == nil:
		// It reads zeros now: copy-on-write may skip zeros in it.
		if d.zeroed == nil {
			d.zeroed = map[int64]bool{}
		}
		if len(d.zeroed) < 1<<16 {
			d.zeroed[c] = true
		}
	case !unsupported(err):
		return d.fail(err)
	}
	return nil
}

// zeroDataFile makes [off, off+n) of the external data file read zeros,
// after any write in flight there: punched, or where the file system
// cannot punch, written with zeros.
func (d *hostDoor) zeroDataFile(off, n int64) error {
	d.behind.wait(off, off+n)
	err := d.df.Punch(off, n)
	if err == nil {
		return nil
	}
	if !unsupported(err) {
		return d.fail(err)
	}
	for pos := off; pos < off+n; pos += int64(len(zeroes)) {
		if _, err := d.df.WriteAt(zeroes[:min(off+n-pos, int64(len(zeroes)))], pos); err != nil {
			return d.fail(err)
		}
	}
	return nil
}
