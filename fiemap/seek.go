package fiemap

import (
	"errors"
	"fmt"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// A seeker is the descriptor a Map runs lseek(SEEK_DATA/SEEK_HOLE) on.
// lseek moves the file offset, which belongs to the open file description
// and so is shared by dup(2)ed descriptors; a seeker therefore reopens the
// file through /proc/self/fd/N, which makes a new description with an
// offset of its own. Where that fails (no /proc, a file opened write-only)
// it uses the mapped file's own descriptor, whose offset is then moved:
// harmless to ReadAt (pread) users, which is what a mapped file is for.
// A seeker is used under Map.fillMu only.
type seeker struct {
	rc     syscall.RawConn
	own    *os.File // the private reopen, or nil
	broken bool     // lseek(SEEK_DATA) is not implemented here
}

func (m *Map) seeker() *seeker {
	if m.seek != nil {
		return m.seek
	}
	m.seek = &seeker{rc: m.rc}
	var fd uintptr
	if m.rc.Control(func(f uintptr) { fd = f }) == nil {
		if f, err := os.Open(fmt.Sprintf("/proc/self/fd/%d", fd)); err == nil {
			if rc, err := f.SyscallConn(); err == nil {
				m.seek.rc, m.seek.own = rc, f
			} else {
				f.Close()
			}
		}
	}
	return m.seek
}

func (s *seeker) close() error {
	if s.own != nil {
		return s.own.Close()
	}
	return nil
}

// lseek is lseek(2) on the seeker's descriptor, counted in Stats.
func (m *Map) lseek(off int64, whence int) (int64, error) {
	s := m.seeker()
	m.lseeks.Add(1)
	var r int64
	var serr error
	if err := s.rc.Control(func(fd uintptr) { r, serr = unix.Seek(int(fd), off, whence) }); err != nil {
		return 0, err
	}
	return r, serr
}

// seekError wraps err from lseek(whence, off) with what and where.
func (m *Map) seekError(whence int, off int64, err error) error {
	name := "SEEK_DATA"
	if whence == unix.SEEK_HOLE {
		name = "SEEK_HOLE"
	}
	return fmt.Errorf("fiemap: %s: lseek(%s, %d): %w", m.name, name, off, err)
}

// seekWindow describes a prefix of [off, limit) with lseek: the hole from
// off to the next data, and that data up to the next hole. Two calls per
// extent is what a walk with lseek itself costs, and asking for no more
// than the query needs keeps it so. fillMu must be held.
func (m *Map) seekWindow(off, limit int64) (*window, error) {
	d, err := m.lseek(off, unix.SEEK_DATA)
	if errors.Is(err, syscall.ENXIO) || err == nil && d >= limit {
		return &window{start: off, end: limit}, nil
	}
	if err != nil {
		return nil, m.seekError(unix.SEEK_DATA, off, err)
	}
	if d < off {
		return nil, m.seekError(unix.SEEK_DATA, off, fmt.Errorf("returned %d: %w", d, errBadReply))
	}
	h, err := m.holeAfter(d, limit)
	if err != nil {
		return nil, err
	}
	return &window{start: off, end: h, runs: []run{{d, h}}}, nil
}

// holeAfter returns lseek(SEEK_HOLE, d) for a data offset d, capped at
// limit.
func (m *Map) holeAfter(d, limit int64) (int64, error) {
	h, err := m.lseek(d, unix.SEEK_HOLE)
	if errors.Is(err, syscall.ENXIO) {
		return limit, nil // the file shrank under us; it must not
	}
	if err != nil {
		return 0, m.seekError(unix.SEEK_HOLE, d, err)
	}
	if h <= d {
		return 0, m.seekError(unix.SEEK_HOLE, d, fmt.Errorf("returned %d: %w", h, errBadReply))
	}
	return min(h, limit), nil
}

// seekRuns appends to runs the data in [s, t) of an extent FIEMAP calls
// unwritten, as lseek(SEEK_DATA) sees it (dirty or cached pages), at most
// room (>= 1) runs of it. It returns how far it looked: t, or less when
// room ran out. Where lseek is not implemented the extent is a hole.
// fillMu must be held.
func (m *Map) seekRuns(runs []run, s, t int64, room int) ([]run, int64, error) {
	for s < t && !m.seeker().broken {
		d, err := m.lseek(s, unix.SEEK_DATA)
		if errors.Is(err, syscall.ENXIO) {
			break
		}
		if err != nil {
			if unsupported(err) {
				m.seek.broken = true
				break
			}
			return nil, 0, m.seekError(unix.SEEK_DATA, s, err)
		}
		if d >= t {
			break
		}
		if d < s {
			return nil, 0, m.seekError(unix.SEEK_DATA, s, fmt.Errorf("returned %d: %w", d, errBadReply))
		}
		if room == 0 {
			return runs, d, nil // [s, d) is a hole; d is for the next window
		}
		h, err := m.holeAfter(d, t)
		if err != nil {
			return nil, 0, err
		}
		runs = appendRun(runs, d, h)
		room--
		s = h
	}
	return runs, t, nil
}
