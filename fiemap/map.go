package fiemap

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
)

// Defaults for [Options].
const (
	// DefaultWindowExtents is how many extents one FIEMAP call asks for:
	// 256 extents are a 14 KiB ioctl buffer.
	DefaultWindowExtents = 256
	// DefaultCacheExtents bounds the cache at about 1 MiB of extents.
	DefaultCacheExtents = 64 << 10
)

// Options tune a [Map]. The zero value, or a nil *Options, means the
// defaults.
type Options struct {
	// WindowExtents is the most extents asked of the kernel in one
	// FS_IOC_FIEMAP call; default DefaultWindowExtents.
	WindowExtents int
	// CacheExtents is the memory budget: the most data extents kept
	// cached, summed over all windows, each window counting as one extent
	// more. Default DefaultCacheExtents; raised to WindowExtents+1 if
	// smaller. The window just asked for is always kept, so the cache can
	// exceed the budget by at most one window.
	CacheExtents int
	// Sync asks FIEMAP to write the file's dirty pages back first
	// (FIEMAP_FLAG_SYNC). Unwritten extents are then holes outright,
	// without the lseek check of the page cache (see the package
	// comment), so answers do not depend on which pages happen to be
	// cached: the price is writeback of whatever is dirty in the file.
	Sync bool
}

// A Method is the way a Map asks the host about a file.
type Method int32

const (
	// MethodUnknown: the host has not been asked yet.
	MethodUnknown Method = iota
	// MethodFiemap: the FS_IOC_FIEMAP ioctl (plus lseek(SEEK_DATA) over
	// unwritten extents, see the package comment).
	MethodFiemap
	// MethodLseek: lseek(SEEK_DATA/SEEK_HOLE), because the filesystem
	// does not implement FIEMAP.
	MethodLseek
	// MethodNone: neither works; every byte is reported as data.
	MethodNone
)

func (m Method) String() string {
	switch m {
	case MethodUnknown:
		return "unknown"
	case MethodFiemap:
		return "fiemap"
	case MethodLseek:
		return "lseek"
	case MethodNone:
		return "none"
	}
	return fmt.Sprintf("Method(%d)", int32(m))
}

// Stats describe a Map's work so far.
type Stats struct {
	Method    Method // how the host is asked
	Fiemaps   int64  // FS_IOC_FIEMAP ioctls made, failed ones included
	Lseeks    int64  // lseek(SEEK_DATA/SEEK_HOLE) calls made
	Fills     int64  // cache misses, each answered by one or more host calls
	Evictions int64  // windows evicted to stay within the budget
	Windows   int    // windows cached now
	Extents   int    // data extents cached now
}

// HostCalls is the number of system calls made to the host file system.
func (s Stats) HostCalls() int64 { return s.Fiemaps + s.Lseeks }

// A Map answers where a regular file holds data and where it has holes.
// The file must not be written while it is mapped: answers are cached for
// the life of the Map. A Map is safe for concurrent use.
//
// Locking: mu guards the cache (windows, cost, hand, and each window's
// evicted mark); queries hold it for reading while they find a window,
// fills hold it for writing only to insert and evict. Windows are immutable
// once cached (but for their atomic reference bit), so a query reads a
// window's extents after letting mu go. fillMu serializes everything that
// asks the host: it guards method changes, buf, scr, seek and closed, so two
// misses never ask the host about the same region twice. A query that hits
// the cache never takes fillMu.
type Map struct {
	f             *os.File
	name          string
	size          int64
	windowExtents int
	budget        int
	sync          bool

	mu      sync.RWMutex
	windows []*window // sorted by start, disjoint
	cost    int       // sum of windows' cost()
	hand    int       // CLOCK hand, an index into windows

	fillMu sync.Mutex
	rc     syscall.RawConn // f's descriptor, for the ioctl
	buf    []uint64        // FIEMAP request and reply, 8-byte aligned
	scr    []run           // scratch extents of the window being filled
	seek   *seeker         // lseek descriptor, opened on first use
	closed bool

	method                            atomic.Int32 // a Method; changed under fillMu
	fiemaps, lseeks, fills, evictions atomic.Int64
}

// New maps the regular file f, whose size is taken now. f must stay open
// and unwritten while the Map is used; the Map does not close it. opt may
// be nil. New makes no host call beyond fstat(2): the file is asked about
// when first queried.
func New(f *os.File, opt *Options) (*Map, error) {
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("fiemap: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("fiemap: %s: not a regular file (%v): %w", f.Name(), fi.Mode().Type(), fs.ErrInvalid)
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("fiemap: %s: %w", f.Name(), err)
	}
	var o Options
	if opt != nil {
		o = *opt
	}
	if o.WindowExtents <= 0 {
		o.WindowExtents = DefaultWindowExtents
	}
	if o.CacheExtents <= 0 {
		o.CacheExtents = DefaultCacheExtents
	}
	o.CacheExtents = max(o.CacheExtents, o.WindowExtents+1)
	return &Map{
		f:             f,
		name:          f.Name(),
		size:          fi.Size(),
		windowExtents: o.WindowExtents,
		budget:        o.CacheExtents,
		sync:          o.Sync,
		rc:            rc,
	}, nil
}

// Close releases the Map's own resources (a descriptor used for lseek, the
// cache). It does not close the mapped file. Queries after Close fail with
// an error wrapping os.ErrClosed.
func (m *Map) Close() error {
	m.fillMu.Lock()
	defer m.fillMu.Unlock()
	if m.closed {
		return nil
	}
	m.closed = true
	m.mu.Lock()
	m.windows, m.cost, m.hand = nil, 0, 0
	m.mu.Unlock()
	m.buf, m.scr = nil, nil
	if m.seek != nil {
		return m.seek.close()
	}
	return nil
}

// Size is the file's size when it was mapped.
func (m *Map) Size() int64 { return m.size }

// Stats returns the Map's counters.
func (m *Map) Stats() Stats {
	m.mu.RLock()
	windows, cost := len(m.windows), m.cost
	m.mu.RUnlock()
	return Stats{
		Method:    Method(m.method.Load()),
		Fiemaps:   m.fiemaps.Load(),
		Lseeks:    m.lseeks.Load(),
		Fills:     m.fills.Load(),
		Evictions: m.evictions.Load(),
		Windows:   windows,
		Extents:   cost - windows,
	}
}

// NextData is lseek(SEEK_DATA): it returns the first offset at or after
// off that holds data. It returns io.EOF when there is none before the end
// of the file (lseek's ENXIO), in particular when off >= Size().
func (m *Map) NextData(off int64) (int64, error) {
	if off < 0 {
		return 0, m.negative("NextData", off)
	}
	for off < m.size {
		w, err := m.window(off)
		if err != nil {
			return 0, err
		}
		if i := w.search(off); i < len(w.runs) {
			return max(off, w.runs[i].start), nil
		}
		off = w.end
	}
	return 0, io.EOF
}

// NextHole is lseek(SEEK_HOLE): it returns the first offset at or after
// off that is in a hole, the end of the file counting as one. It returns
// io.EOF when off >= Size() (lseek's ENXIO).
func (m *Map) NextHole(off int64) (int64, error) {
	if off < 0 {
		return 0, m.negative("NextHole", off)
	}
	if off >= m.size {
		return 0, io.EOF
	}
	for {
		w, err := m.window(off)
		if err != nil {
			return 0, err
		}
		i := w.search(off)
		if i == len(w.runs) || w.runs[i].start > off {
			return off, nil // off is in a hole
		}
		// off is data up to the extent's end; past the window's end,
		// the next window says whether data goes on.
		if off = w.runs[i].end; off < w.end || off >= m.size {
			return off, nil
		}
	}
}

// Data reports whether [off, off+length) holds any data. The part of the
// range past the end of the file holds none.
func (m *Map) Data(off, length int64) (bool, error) {
	if off < 0 {
		return false, m.negative("Data", off)
	}
	if length <= 0 || off >= m.size {
		return false, nil
	}
	d, err := m.NextData(off)
	if err == io.EOF {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return d-off < length, nil
}

func (m *Map) negative(op string, off int64) error {
	return fmt.Errorf("fiemap: %s %s: negative offset %d: %w", op, m.name, off, fs.ErrInvalid)
}

// window returns the cached window holding off (0 <= off < size), asking
// the host for one on a miss.
func (m *Map) window(off int64) (*window, error) {
	m.mu.RLock()
	w, _ := m.locate(off)
	m.mu.RUnlock()
	if w != nil {
		w.touch()
		return w, nil
	}
	return m.fill(off)
}

// fill asks the host about the region from off to the next cached window
// and caches the answer.
func (m *Map) fill(off int64) (*window, error) {
	m.fillMu.Lock()
	defer m.fillMu.Unlock()
	m.mu.RLock()
	w, limit := m.locate(off)
	m.mu.RUnlock()
	if w != nil { // filled by another query while we waited
		w.touch()
		return w, nil
	}
	if m.closed {
		return nil, fmt.Errorf("fiemap: %s: %w", m.name, os.ErrClosed)
	}
	m.fills.Add(1)
	w, err := m.ask(off, limit)
	if err != nil {
		return nil, err
	}
	w.ref.Store(true)
	m.mu.Lock()
	m.insert(w)
	m.mu.Unlock()
	return w, nil
}

// ask describes [off, limit) or a prefix of it, with the first method
// that works. fillMu must be held.
func (m *Map) ask(off, limit int64) (*window, error) {
	switch Method(m.method.Load()) {
	case MethodUnknown, MethodFiemap:
		w, err := m.fiemapWindow(off, limit)
		if err == nil {
			m.method.Store(int32(MethodFiemap))
			return w, nil
		}
		// A file system that does not implement FIEMAP, or answers
		// nonsense, is asked with lseek from now on.
		if !unsupported(err) && !errors.Is(err, errBadReply) {
			return nil, err
		}
		m.method.Store(int32(MethodLseek))
		fallthrough
	case MethodLseek:
		w, err := m.seekWindow(off, limit)
		if err == nil {
			return w, nil
		}
		if !unsupported(err) {
			return nil, err
		}
		m.method.Store(int32(MethodNone))
	}
	// MethodNone: all data.
	return &window{start: off, end: limit, runs: []run{{off, limit}}}, nil
}

// unsupported reports whether err from FS_IOC_FIEMAP or lseek means the
// file system does not implement the call, rather than an I/O error.
// The arguments a Map passes are valid, so EINVAL is "not implemented" too.
func unsupported(err error) bool {
	for _, e := range []syscall.Errno{syscall.EOPNOTSUPP, syscall.ENOTTY, syscall.EINVAL, syscall.ENOSYS, syscall.ESPIPE} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}
