package readahead

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"sync"
	"sync/atomic"
)

// A span is a byte range: n bytes at off.
type span struct {
	off int64
	n   int64
}

var (
	errBad       = errors.New("bad sector")
	errTransient = errors.New("transient failure")
	errNegative  = errors.New("negative offset")
)

// memReader is the underlying reader of the tests: an io.ReaderAt over
// data in memory that logs every call and can fail or block on demand.
type memReader struct {
	data     []byte
	eagerEOF bool // return io.EOF with the last bytes, as io.ReaderAt allows
	bad      span // bytes that cannot be read: a read gets those before and errBad

	failNext atomic.Int32 // fail this many next calls with errTransient

	gate   chan struct{} // if not nil, calls starting at or past gateAt wait for it to close
	gateAt int64

	mu     sync.Mutex
	log    []span // every call's range
	maxLen int64  // the longest call
}

func newMemReader(size int, seed uint64) *memReader {
	return &memReader{data: randomData(size, seed)}
}

func randomData(size int, seed uint64) []byte {
	var s [32]byte
	s[0], s[1] = byte(seed), byte(seed>>8)
	b := make([]byte, size)
	rand.NewChaCha8(s).Read(b)
	return b
}

func (m *memReader) ReadAt(p []byte, off int64) (int, error) {
	m.mu.Lock()
	m.log = append(m.log, span{off, int64(len(p))})
	m.maxLen = max(m.maxLen, int64(len(p)))
	m.mu.Unlock()
	if m.gate != nil && off >= m.gateAt {
		<-m.gate
	}
	if m.failNext.Add(-1) >= 0 {
		return 0, errTransient
	}
	return m.oracle().ReadAt(p, off)
}

// calls returns the log of calls so far.
func (m *memReader) calls() []span {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]span(nil), m.log...)
}

// oracle returns an io.ReaderAt reading m's data with m's semantics
// (EOF, bad bytes) but without logging, failing or blocking: what the
// tests compare the Reader with.
func (m *memReader) oracle() io.ReaderAt { return oracle{m} }

type oracle struct{ m *memReader }

func (o oracle) ReadAt(p []byte, off int64) (int, error) {
	m := o.m
	if off < 0 {
		return 0, errNegative
	}
	size := int64(len(m.data))
	if off >= size {
		return 0, io.EOF
	}
	n := copy(p, m.data[off:])
	if m.bad.n > 0 && off < m.bad.off+m.bad.n && off+int64(n) > m.bad.off {
		return int(max(0, m.bad.off-off)), errBad
	}
	if n < len(p) || (m.eagerEOF && off+int64(n) == size) {
		return n, io.EOF
	}
	return n, nil
}

// diffRead reads n bytes at off through r and from want, and describes how
// the results differ, or returns nil. io.ReaderAt lets a read that fills p
// at the end of the data return nil or io.EOF; r must then return nil or
// what want returned.
func diffRead(r, want io.ReaderAt, off int64, n int) error {
	got := make([]byte, n)
	gn, gerr := r.ReadAt(got, off)
	exp := make([]byte, n)
	wn, werr := want.ReadAt(exp, off)
	ok := gn == wn && bytes.Equal(got[:gn], exp[:wn])
	if wn < n {
		ok = ok && gerr == werr
	} else {
		ok = ok && (gerr == nil || gerr == werr)
	}
	if !ok {
		return fmt.Errorf("ReadAt(%d bytes at %d) = %d, %v; the underlying reader says %d, %v (bytes equal: %v)",
			n, off, gn, gerr, wn, werr, bytes.Equal(got[:min(gn, wn)], exp[:min(gn, wn)]))
	}
	return nil
}

// clusters returns the host reads of a sequential scan of a compressed
// qcow2 image stored in the first size bytes of a file: clusters of 2-64
// KiB packed back to back, each starting 0-511 bytes before the previous
// one ends (they share a sector).
func clusters(size int64, seed uint64) []span { return clustersUpTo(size, 64<<10, seed) }

// clustersUpTo is clusters with clusters of 2 KiB to maxLen bytes.
func clustersUpTo(size, maxLen int64, seed uint64) []span {
	rng := rand.New(rand.NewPCG(seed, 1))
	var cs []span
	for off := int64(0); off < size; {
		n := min(2<<10+rng.Int64N(maxLen-2<<10+1), size-off)
		cs = append(cs, span{off, n})
		if off+n == size {
			break
		}
		off += n - int64(rng.IntN(512))
	}
	return cs
}

// settle waits for r's prefetches in flight.
func settle(r *Reader) { r.wg.Wait() }
