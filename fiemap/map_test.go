package fiemap

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"slices"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// configs are the ways a Map is tried on every layout: each method the
// host can be asked with, and windows and caches small enough that every
// window boundary and eviction path is crossed.
var configs = []struct {
	name   string
	opt    *Options
	method Method // forced unless MethodUnknown
	cached bool   // the cache holds the whole file: a second pass is free
}{
	{"auto", nil, MethodUnknown, true},
	{"auto tiny", &Options{WindowExtents: 2, CacheExtents: 3}, MethodUnknown, false},
	{"lseek", nil, MethodLseek, true},
	{"lseek tiny", &Options{WindowExtents: 2, CacheExtents: 3}, MethodLseek, false},
	// With Sync, dirty pages are written back before mapping: the kernel's
	// answers (taken before) stay right, and unwritten extents are holes
	// without a look at the page cache.
	{"sync", &Options{Sync: true}, MethodUnknown, true},
	{"sync tiny", &Options{Sync: true, WindowExtents: 2, CacheExtents: 3}, MethodUnknown, false},
}

// TestMatchesKernel compares a Map with the kernel's own
// lseek(SEEK_DATA/SEEK_HOLE) on every layout, file system and config:
// cold point queries at every extent boundary and at random offsets, then
// a full walk, then (where the cache holds the file) the same again with
// no host call.
func TestMatchesKernel(t *testing.T) {
	forEachFS(t, func(t *testing.T, dir string, typ int64) {
		for i, l := range layouts {
			t.Run(l.name, func(t *testing.T) {
				f := makeFile(t, dir, fmt.Sprintf("layout%d", i), l.build)
				k := newKernel(t, f)
				want := k.walk(t)
				offs := probes(k.size, want, 200, uint64(i))
				for _, c := range configs {
					t.Run(c.name, func(t *testing.T) {
						m := newMap(t, f, c.opt, c.method)
						checkProbes(t, m, k, offs)
						if got := walk(t, m); !slices.Equal(got, want) {
							t.Fatalf("walk:\n got %v\nwant %v", clipRuns(got), clipRuns(want))
						}
						st := m.Stats()
						t.Logf("%d data extents: %+v", len(want), st)
						checkBudget(t, m)
						if k.size > 0 && c.method == MethodUnknown {
							if w := wantMethod(typ); w != MethodUnknown && st.Method != w {
								t.Errorf("method %v, want %v", st.Method, w)
							}
						}
						if c.cached {
							walk(t, m)
							checkProbes(t, m, k, offs)
							if again := m.Stats(); again.HostCalls() != st.HostCalls() {
								t.Errorf("second pass made %d host calls", again.HostCalls()-st.HostCalls())
							}
						}
						// The mapped file's own offset is not moved: lseek
						// runs on a private reopen.
						if pos, err := f.Seek(0, io.SeekCurrent); err != nil || pos != 0 {
							t.Errorf("mapped file's offset = %d, %v; want 0", pos, err)
						}
					})
				}
			})
		}
	})
}

// checkProbes asks m and the kernel NextData, NextHole and Data at offs.
func checkProbes(t *testing.T, m *Map, k *kernel, offs []int64) {
	t.Helper()
	for _, off := range offs {
		for _, q := range []struct {
			name   string
			whence int
			next   func(int64) (int64, error)
		}{
			{"NextData", unix.SEEK_DATA, m.NextData},
			{"NextHole", unix.SEEK_HOLE, m.NextHole},
		} {
			got, gerr := q.next(off)
			want, werr := k.next(t, off, q.whence)
			if gerr != werr || got != want {
				t.Fatalf("%s(%d) = %d, %v; kernel says %d, %v", q.name, off, got, gerr, want, werr)
			}
		}
		d, derr := k.next(t, off, unix.SEEK_DATA)
		for _, n := range []int64{1, 4096, 65536} {
			want := derr == nil && d-off < n
			if got, err := m.Data(off, n); err != nil || got != want {
				t.Fatalf("Data(%d, %d) = %v, %v; kernel says %v", off, n, got, err, want)
			}
		}
	}
}

// checkBudget checks that the cache holds at most its budget plus the one
// window it always keeps (at most twice WindowExtents runs).
func checkBudget(t *testing.T, m *Map) {
	t.Helper()
	st := m.Stats()
	if max := m.budget + 2*m.windowExtents + 1; st.Extents+st.Windows > max {
		t.Errorf("cache holds %d extents in %d windows, budget %d (+ one window)", st.Extents, st.Windows, m.budget)
	}
}

// clipRuns shortens long run lists in failure messages.
func clipRuns(r []run) string {
	if len(r) > 20 {
		return fmt.Sprintf("%v ... %v (%d runs)", r[:10], r[len(r)-10:], len(r))
	}
	return fmt.Sprint(r)
}

// TestUnwrittenNeedsCheck shows why unwritten extents are checked with
// lseek: right after a buffered write into fallocated space, FIEMAP still
// calls the whole range unwritten, while the data sits in dirty pages.
// Where FIEMAP does that, the Map must still report the data.
func TestUnwrittenNeedsCheck(t *testing.T) {
	dir := t.TempDir()
	if typ, name := fsType(t, dir); wantMethod(typ) != MethodFiemap {
		t.Skipf("%s has no FIEMAP", name)
	}
	f := makeFile(t, dir, "f", steps(fallocate(0, 0, 1<<20), write(40960, 8192)))
	m := newMap(t, f, nil, MethodUnknown)
	if err := m.fiemapWindowRaw(t); err != nil {
		t.Fatal(err)
	}
	d, err := m.NextData(0)
	if err != nil || d != 40960 {
		t.Fatalf("NextData(0) = %d, %v; want 40960", d, err)
	}
	h, err := m.NextHole(d)
	if err != nil || h != 40960+8192 {
		t.Fatalf("NextHole(%d) = %d, %v; want %d", d, h, err, 40960+8192)
	}
	if st := m.Stats(); st.Lseeks == 0 {
		t.Errorf("no lseek check of the unwritten extent: %+v", st)
	}
}

// fiemapWindowRaw logs what FIEMAP alone says about the file, for the
// record.
func (m *Map) fiemapWindowRaw(t *testing.T) error {
	exts, err := fiemap(m.rc, make([]uint64, (fiemapHeaderSize+16*fiemapExtentSize)/8), 0, m.size, 0)
	for _, e := range exts {
		t.Logf("FIEMAP alone: [%d, +%d) flags %#x", e.feLogical, e.feLength, e.feFlags)
	}
	return err
}

// TestEdges covers arguments outside the file.
func TestEdges(t *testing.T) {
	f := makeFile(t, t.TempDir(), "f", steps(truncate(1<<20), write(8192, 4096)))
	m := newMap(t, f, nil, MethodUnknown)
	tests := []struct {
		name string
		call func() (any, error)
		want any
		err  error
	}{
		{"NextData(-1)", func() (any, error) { return m.NextData(-1) }, int64(0), fs.ErrInvalid},
		{"NextHole(-1)", func() (any, error) { return m.NextHole(-1) }, int64(0), fs.ErrInvalid},
		{"Data(-1, 10)", func() (any, error) { return m.Data(-1, 10) }, false, fs.ErrInvalid},
		{"NextData(size)", func() (any, error) { return m.NextData(1 << 20) }, int64(0), io.EOF},
		{"NextHole(size)", func() (any, error) { return m.NextHole(1 << 20) }, int64(0), io.EOF},
		{"NextData(huge)", func() (any, error) { return m.NextData(1<<63 - 1) }, int64(0), io.EOF},
		{"NextHole(size-1)", func() (any, error) { return m.NextHole(1<<20 - 1) }, int64(1<<20 - 1), nil},
		{"Data(size, 10)", func() (any, error) { return m.Data(1<<20, 10) }, false, nil},
		{"Data(0, 0)", func() (any, error) { return m.Data(0, 0) }, false, nil},
		{"Data(0, -1)", func() (any, error) { return m.Data(0, -1) }, false, nil},
		{"Data(0, 8192)", func() (any, error) { return m.Data(0, 8192) }, false, nil},
		{"Data(0, 8193)", func() (any, error) { return m.Data(0, 8193) }, true, nil},
		{"Data(12287, huge)", func() (any, error) { return m.Data(12287, 1<<63-1) }, true, nil},
		{"Data(12288, huge)", func() (any, error) { return m.Data(12288, 1<<63-1) }, false, nil},
	}
	for _, tt := range tests {
		got, err := tt.call()
		if got != tt.want || !errors.Is(err, tt.err) || (err == nil) != (tt.err == nil) {
			t.Errorf("%s = %v, %v; want %v, %v", tt.name, got, err, tt.want, tt.err)
		}
	}
}

// TestNoMethod forces the last fallback, where neither FIEMAP nor lseek
// works: everything is data, and the host is never asked.
func TestNoMethod(t *testing.T) {
	for _, l := range []layout{layouts[0], layouts[1], layouts[3]} {
		t.Run(l.name, func(t *testing.T) {
			f := makeFile(t, t.TempDir(), "f", l.build)
			m := newMap(t, f, &Options{WindowExtents: 2, CacheExtents: 3}, MethodNone)
			var want []run
			if m.Size() > 0 {
				want = []run{{0, m.Size()}}
			}
			if got := walk(t, m); !slices.Equal(got, want) {
				t.Errorf("walk = %v, want %v", got, want)
			}
			for _, off := range []int64{0, 1, m.Size() / 2} {
				if off >= m.Size() {
					continue
				}
				if h, err := m.NextHole(off); err != nil || h != m.Size() {
					t.Errorf("NextHole(%d) = %d, %v; want %d", off, h, err, m.Size())
				}
			}
			if st := m.Stats(); st.HostCalls() != 0 || st.Method != MethodNone {
				t.Errorf("stats %+v, want no host calls", st)
			}
		})
	}
}

// TestUnsupported checks which errors switch a Map to the next method.
func TestUnsupported(t *testing.T) {
	tests := []struct {
		err  error
		want bool
	}{
		{syscall.EOPNOTSUPP, true}, // tmpfs, FUSE: no fiemap inode operation
		{syscall.ENOTTY, true},
		{syscall.EINVAL, true},
		{syscall.ENOSYS, true},
		{syscall.ESPIPE, true},
		{fmt.Errorf("fiemap: f: FS_IOC_FIEMAP from offset 0: %w", syscall.EOPNOTSUPP), true},
		{syscall.EIO, false},
		{syscall.ENOMEM, false},
		{os.ErrClosed, false},
	}
	for _, tt := range tests {
		if got := unsupported(tt.err); got != tt.want {
			t.Errorf("unsupported(%v) = %v, want %v", tt.err, got, tt.want)
		}
	}
}

// TestClose checks that queries after Close fail, and Close twice is fine.
func TestClose(t *testing.T) {
	f := makeFile(t, t.TempDir(), "f", steps(truncate(1<<20), write(8192, 4096)))
	for _, method := range []Method{MethodUnknown, MethodLseek} {
		m := newMap(t, f, nil, method)
		if _, err := m.NextData(0); err != nil {
			t.Fatal(err)
		}
		if err := m.Close(); err != nil {
			t.Fatal(err)
		}
		if _, err := m.NextData(0); !errors.Is(err, os.ErrClosed) {
			t.Errorf("%v: NextData after Close: %v, want os.ErrClosed", method, err)
		}
		if err := m.Close(); err != nil {
			t.Errorf("%v: second Close: %v", method, err)
		}
	}
}

// TestNotRegular refuses what is not a regular file.
func TestNotRegular(t *testing.T) {
	d, err := os.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if _, err := New(d, nil); !errors.Is(err, fs.ErrInvalid) {
		t.Errorf("New(folder) = %v, want fs.ErrInvalid", err)
	}
}
