package fat

import (
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"

	"github.com/qcowfs/qcowfs/guestfs"
)

// FS is a FAT12, FAT16 or FAT32 file system, read-only, as Linux's vfat
// shows it with its default mount options (doc.go). It is safe for
// concurrent use: after Open its fields do not change, and its caches
// lock themselves.
type FS struct {
	r     io.ReaderAt
	size  int64
	g     *geometry
	fat   *fatTable
	label string

	dirs   *lru[uint32, *dirData] // parsed directories by key (dirKey)
	chains *lru[uint32, *chain]   // cluster chains by first cluster
}

var _ guestfs.FS = (*FS)(nil)

// Cache budgets: parsed directories by an estimate of their bytes, chains
// by count (each at most maxRuns runs).
const (
	dirCacheBytes = 16 << 20
	chainCacheLen = 512
	// maxDirBytes is the largest directory: 65536 entries (FAT's and
	// Linux's FAT_MAX_DIR_ENTRIES), which keeps an entry's index in an
	// inode number's 16 bits.
	maxDirBytes = 65536 * direntLen
)

// guestfs.Open hands it the partitions Probe names "vfat".
func init() {
	guestfs.Register("vfat", func(r io.ReaderAt, size int64) (guestfs.FS, error) { return Open(r, size) })
}

// Open reads the FAT file system in r, a partition of size bytes. It
// checks the boot sector and reads the root directory; everything else is
// read when asked for. A damaged boot sector or root directory is a
// *guestfs.FormatError (errors.Is guestfs.ErrCorrupt).
func Open(r io.ReaderAt, size int64) (*FS, error) {
	f := &FS{r: r, size: size}
	b := make([]byte, bootSectorLen)
	if size < bootSectorLen {
		return nil, bootErr("partition size", uint64(max(size, 0)), "smaller than a boot sector")
	}
	if err := f.readAt(b, 0); err != nil {
		return nil, err
	}
	g, err := parseBoot(b, size)
	if err != nil {
		return nil, err
	}
	f.g = g
	f.fat = newFATTable(g, f.readAt)
	f.dirs = newLRU[uint32, *dirData](dirCacheBytes)
	f.chains = newLRU[uint32, *chain](chainCacheLen)
	root, err := f.dir(rootKey)
	if err != nil {
		return nil, err
	}
	f.label = root.pd.label
	if f.label == "" && g.label != "NO NAME    " {
		f.label = strings.TrimRight(g.label, " ")
	}
	return f, nil
}

// readAt reads len(p) bytes at off, refusing any byte outside the
// partition.
func (f *FS) readAt(p []byte, off int64) error {
	if off < 0 || off > f.size-int64(len(p)) {
		return &guestfs.FormatError{FS: fsType, Field: "byte offset", Value: uint64(off),
			Msg: fmt.Sprintf("%d bytes there are past the end of the partition (%d bytes)", len(p), f.size)}
	}
	n, err := f.r.ReadAt(p, off)
	if n == len(p) {
		return nil
	}
	if err == nil || err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	return fmt.Errorf("vfat: reading %d bytes at %d: %w", len(p), off, err)
}

func (f *FS) Type() string  { return fsType }
func (f *FS) Label() string { return f.label }

// chain returns the cluster chain from cluster start (checked to exist).
func (f *FS) chain(start uint32) *chain {
	if ch, ok := f.chains.get(start); ok {
		return ch
	}
	ch := newChain(f.fat, start)
	f.chains.put(start, ch, 1)
	return ch
}

// validCluster says whether c is a cluster of the data area.
func (f *FS) validCluster(c uint32) bool { return c >= firstCluster && c < f.g.maxCluster }

// A directory is known by its key: rootKey for the root, else its first
// cluster.
const rootKey = 0

// dirData is a directory read and parsed, with its size as Linux shows
// it (the clusters of its chain, or the FAT12/16 root region) and an
// index of its names for lookups.
type dirData struct {
	pd     *parsedDir
	size   int64
	byName map[string][]int32 // folded short and long names -> entries, in order
}

// dir reads and parses directory key.
func (f *FS) dir(key uint32) (*dirData, error) {
	if d, ok := f.dirs.get(key); ok {
		return d, nil
	}
	var b []byte
	switch {
	case key == rootKey && f.g.bits != 32:
		b = make([]byte, f.g.rootEntries*direntLen)
		if err := f.readAt(b, f.g.rootStart); err != nil {
			return nil, err
		}
	default:
		start := key
		if key == rootKey {
			start = f.g.rootCluster
		}
		var err error
		if b, err = f.readChain(start, maxDirBytes); err != nil {
			return nil, err
		}
	}
	d := &dirData{pd: parseDir(b, f.g.bits == 32), size: int64(len(b)), byName: map[string][]int32{}}
	cost := 256
	for i := range d.pd.entries {
		e := &d.pd.entries[i]
		cost += 96
		if e.short == "" {
			continue // Linux's fat_search_long skips it
		}
		for _, n := range []string{e.short, e.long} {
			if n == "" || (n == e.long && !e.hasLong) {
				continue
			}
			k := fold(n)
			if l := d.byName[k]; len(l) == 0 || l[len(l)-1] != int32(i) {
				d.byName[k] = append(l, int32(i))
			}
			cost += 2*len(n) + 48
		}
	}
	f.dirs.put(key, d, cost)
	return d, nil
}

// readChain reads the whole chain from start, refusing one of more than
// limit bytes.
func (f *FS) readChain(start uint32, limit int64) ([]byte, error) {
	if !f.validCluster(start) {
		return nil, chainErr(start, "not a cluster of the data area (2 to %d)", f.g.maxCluster-1)
	}
	ch := f.chain(start)
	maxClusters := uint32((limit + f.g.clusterSize - 1) / f.g.clusterSize)
	n, err := ch.length(maxClusters)
	if errors.Is(err, errTooLong) {
		return nil, chainErr(start, "a directory of more than %d clusters (%d bytes)", maxClusters, limit)
	}
	if err != nil {
		return nil, err
	}
	b := make([]byte, int64(n)*f.g.clusterSize)
	for i := uint32(0); i < n; {
		disk, contig, err := ch.lookup(i, n-1)
		if err != nil {
			return nil, err
		}
		contig = min(contig, n-i)
		off := int64(i) * f.g.clusterSize
		if err := f.readAt(b[off:off+int64(contig)*f.g.clusterSize], f.g.clusterOffset(disk)); err != nil {
			return nil, err
		}
		i += contig
	}
	return b, nil
}

// fold is a name as a vfat lookup compares it: ASCII letters without
// regard to case, every other byte as it is (Linux's nls_strnicmp over
// the ascii table).
func fold(n string) string {
	return strings.Map(func(r rune) rune {
		if 'A' <= r && r <= 'Z' {
			return r + 'a' - 'A'
		}
		return r
	}, n)
}

// entry returns the directory entry with inode ino, and the key of the
// directory holding it.
func (f *FS) entry(ino uint64) (uint32, *dirent, error) {
	key, index, ok := splitIno(ino)
	if !ok || (key != rootKey && !f.validCluster(key)) {
		return 0, nil, fmt.Errorf("vfat: inode %d: %w", ino, errNoInode)
	}
	d, err := f.dir(key)
	if err != nil {
		return 0, nil, err
	}
	es := d.pd.entries
	i := sort.Search(len(es), func(i int) bool { return es[i].index >= index })
	if i == len(es) || es[i].index != index {
		return 0, nil, fmt.Errorf("vfat: inode %d: %w", ino, errNoInode)
	}
	return key, &es[i], nil
}

// errNoInode: an inode number that names no file (not one this package
// handed out).
var errNoInode = errors.New("no such inode")

// subdir reads the directory that entry e of directory parent (inode
// ino) is, with the checks Linux's fat_validate_dir makes and one it does
// not: the directory's ".." must name parent. Every directory then has
// one parent, so no walk of the tree can loop, however its entries point.
func (f *FS) subdir(parent uint32, e *dirent, ino uint64) (*dirData, error) {
	c := e.FstClus
	if c == 0 || (f.g.bits == 32 && c == f.g.rootCluster) || !f.validCluster(c) {
		return nil, &guestfs.FormatError{FS: fsType, Inode: ino, Field: "DIR_FstClus", Value: uint64(c),
			Msg: "not a directory's first cluster"}
	}
	d, err := f.dir(c)
	if err != nil {
		return nil, withInode(err, ino)
	}
	dd := d.pd.dotdot
	ok := dd == int64(parent) || (parent == rootKey && f.g.bits == 32 && dd == int64(f.g.rootCluster))
	if !ok {
		msg := fmt.Sprintf("not its parent directory's first cluster (%d, 0 for the root): a directory loop, or a directory moved by a broken tool", parent)
		if dd < 0 {
			dd, msg = 0, "missing: a directory with no '..' entry"
		}
		return nil, &guestfs.FormatError{FS: fsType, Inode: ino, Field: "'..' entry's DIR_FstClus", Value: uint64(dd), Msg: msg}
	}
	return d, nil
}
