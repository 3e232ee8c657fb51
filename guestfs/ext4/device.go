package ext4

import (
	"errors"
	"fmt"
	"io"
)

// device reads the file system's blocks: from the partition, or, for the
// blocks a journal replay rewrites (journal.go), from the journal. It
// refuses any block number at or past s_blocks_count, which ParseSuperblock
// checked fits in the partition: nothing outside the partition is read.
//
// Metadata blocks (inode tables, descriptors, extent, index and directory
// blocks) go through a bounded cache of immutable buffers; file data is
// read straight into the caller's buffer.
type device struct {
	r      io.ReaderAt
	bs     int64
	blocks uint64
	// replay is the journal's replacement for each block it rewrites; nil
	// when nothing is replayed. Set once, in Open, before any reader.
	replay map[uint64]journalBlock
	cache  *blockCache
}

// journalBlock is where in the journal a replayed block's content is, and
// whether its first four bytes were escaped (zeroed because they read as
// jbd2's magic).
type journalBlock struct {
	pblk    uint64
	escaped bool
}

var errBlockRange = errors.New("block number past the end of the file system")

// block returns block pblk, from the cache or read into it. The slice is
// shared: callers must not change it.
func (d *device) block(pblk uint64) ([]byte, error) {
	if b := d.cache.get(pblk); b != nil {
		return b, nil
	}
	b := make([]byte, d.bs)
	if err := d.readBlocks(b, pblk); err != nil {
		return nil, err
	}
	d.cache.put(pblk, b)
	return b, nil
}

// readBlocks fills p (a whole number of blocks) from block pblk on.
func (d *device) readBlocks(p []byte, pblk uint64) error {
	n := uint64(len(p)) / uint64(d.bs)
	if pblk >= d.blocks || n > d.blocks-pblk {
		return fmt.Errorf("reading blocks %d+%d: %w (%d blocks)", pblk, n, errBlockRange, d.blocks)
	}
	if d.replay == nil {
		return d.readRaw(p, int64(pblk)*d.bs)
	}
	// Runs of blocks the journal leaves alone are read in one go.
	start := uint64(0)
	for i := uint64(0); i <= n; i++ {
		jb, replayed := journalBlock{}, false
		if i < n {
			jb, replayed = d.replay[pblk+i]
		}
		if !replayed && i < n {
			continue
		}
		if i > start {
			if err := d.readRaw(p[start*uint64(d.bs):i*uint64(d.bs)], int64(pblk+start)*d.bs); err != nil {
				return err
			}
		}
		start = i + 1
		if replayed {
			q := p[i*uint64(d.bs) : (i+1)*uint64(d.bs)]
			if err := d.readRaw(q, int64(jb.pblk)*d.bs); err != nil {
				return err
			}
			if jb.escaped {
				copy(q, jbd2Magic[:])
			}
		}
	}
	return nil
}

// readAt reads len(p) bytes of file data at byte off of the file system,
// which the caller has bounded by blocks it mapped.
func (d *device) readAt(p []byte, off int64) error {
	if d.replay == nil {
		if off < 0 || uint64(off+int64(len(p))) > d.blocks*uint64(d.bs) {
			return fmt.Errorf("reading bytes %d+%d: %w", off, len(p), errBlockRange)
		}
		return d.readRaw(p, off)
	}
	// Through whole blocks, so that replayed ones are substituted.
	first := off / d.bs
	last := (off + int64(len(p)) + d.bs - 1) / d.bs
	buf := make([]byte, (last-first)*d.bs)
	if err := d.readBlocks(buf, uint64(first)); err != nil {
		return err
	}
	copy(p, buf[off-first*d.bs:])
	return nil
}

func (d *device) readRaw(p []byte, off int64) error {
	n, err := d.r.ReadAt(p, off)
	if n == len(p) {
		return nil
	}
	if err == nil || errors.Is(err, io.EOF) {
		err = io.ErrUnexpectedEOF
	}
	return fmt.Errorf("reading %d bytes at %d: %w", len(p), off, err)
}
