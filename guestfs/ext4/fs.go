package ext4

import (
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/guestfs"
)

// RootIno is the inode of the root directory (EXT4_ROOT_INO).
const RootIno = 2

// DefaultCacheBytes bounds the metadata block cache of an FS opened
// without Options.CacheBytes.
const DefaultCacheBytes = 16 << 20

func init() {
	open := func(r io.ReaderAt, size int64) (guestfs.FS, error) { return Open(r, size) }
	for _, t := range []string{"ext2", "ext3", "ext4"} {
		guestfs.Register(t, open)
	}
}

// Options tune Open.
type Options struct {
	// CacheBytes bounds the cache of metadata blocks (inode tables,
	// extent, indirect and directory blocks); DefaultCacheBytes if 0.
	CacheBytes int64
}

// FS is an ext2, ext3 or ext4 file system, read-only. It implements
// guestfs.FS, and is safe for concurrent use: everything but the block
// cache is fixed once Open returns.
type FS struct {
	sb       *Superblock
	typ      string
	dev      *device
	replayed int
	indexes  dirIndexes // of linear directories (dirindex.go)
}

var _ guestfs.FS = (*FS)(nil)

// Open opens the ext2/3/4 file system in r, a partition of size bytes,
// with default options.
func Open(r io.ReaderAt, size int64) (*FS, error) {
	return OpenOptions(r, size, Options{})
}

// OpenOptions opens the ext2/3/4 file system in r, a partition of size
// bytes. It reads and checks the superblock, replays the journal in
// memory if the file system needs recovery (journal.go), and checks the
// root directory's inode; everything else is read when asked for.
func OpenOptions(r io.ReaderAt, size int64, o Options) (*FS, error) {
	if o.CacheBytes <= 0 {
		o.CacheBytes = DefaultCacheBytes
	}
	if size < superblockOffset+superblockSize {
		return nil, &guestfs.FormatError{FS: "ext4", Field: "partition size", Value: uint64(max(size, 0)), Msg: "too small to hold a superblock"}
	}
	b := make([]byte, superblockSize)
	if n, err := r.ReadAt(b, superblockOffset); n < len(b) {
		if err == nil || errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return nil, fmt.Errorf("ext4: reading the superblock: %w", err)
	}
	sb, err := ParseSuperblock(b, size)
	if err != nil {
		return nil, err
	}
	bs := int64(sb.BlockSize)
	fs := &FS{sb: sb, typ: sb.Type()}
	fs.dev = &device{r: r, bs: bs, blocks: sb.BlocksCount, cache: newBlockCache(o.CacheBytes, bs)}
	if sb.FeatureIncompat&incompatRecover != 0 {
		replay, err := fs.replayJournal()
		if err != nil {
			return nil, err
		}
		if len(replay) > 0 {
			fs.dev.cache.reset()
			fs.dev.replay = replay
			fs.replayed = len(replay)
			// The superblock as the journal left it.
			blk := make([]byte, bs)
			if err := fs.dev.readBlocks(blk, uint64(superblockOffset/bs)); err != nil {
				return nil, fmt.Errorf("%s: the replayed superblock: %w", fs.typ, err)
			}
			sb2, err := ParseSuperblock(blk[superblockOffset%bs:], size)
			if err != nil {
				return nil, fmt.Errorf("the superblock the journal replays: %w", err)
			}
			if sb2.BlockSize != sb.BlockSize {
				return nil, fs.formatError(0, "replayed superblock s_log_block_size", uint64(sb2.LogBlockSize), "differs from the superblock's %d", sb.LogBlockSize)
			}
			fs.sb, fs.typ, fs.dev.blocks = sb2, sb2.Type(), sb2.BlocksCount
		}
	}
	root, err := fs.readInode(RootIno)
	if err != nil {
		return nil, fmt.Errorf("the root directory: %w", err)
	}
	if !root.isDir() {
		return nil, fs.formatError(RootIno, "i_mode", uint64(root.mode), "the root is not a directory")
	}
	return fs, nil
}

// Superblock returns the superblock the file system was opened with
// (after any journal replay).
func (fs *FS) Superblock() Superblock { return *fs.sb }

// Replayed returns the number of blocks the journal replay supplies: 0
// unless the file system needed recovery.
func (fs *FS) Replayed() int { return fs.replayed }

func (fs *FS) Type() string    { return fs.typ }
func (fs *FS) Label() string   { return fs.sb.VolumeName }
func (fs *FS) RootIno() uint64 { return RootIno }

func (fs *FS) formatError(ino uint64, field string, v uint64, format string, args ...any) error {
	return &guestfs.FormatError{FS: fs.typ, Inode: ino, Field: field, Value: v, Msg: fmt.Sprintf(format, args...)}
}

func (fs *FS) notDir(ino uint64) error {
	return fmt.Errorf("%s: inode %d: %w", fs.typ, ino, syscall.ENOTDIR)
}

// StatIno returns inode ino as stat(2) on the kernel's mount shows it.
func (fs *FS) StatIno(ino uint64) (guestfs.Stat, error) {
	in, err := fs.readInode(ino)
	if err != nil {
		return guestfs.Stat{}, err
	}
	return fs.stat(in), nil
}

// Lookup finds name in directory dir and returns its inode. "." is dir,
// ".." its parent as the directory records it.
func (fs *FS) Lookup(dir uint64, name string) (guestfs.Stat, error) {
	d, err := fs.readInode(dir)
	if err != nil {
		return guestfs.Stat{}, err
	}
	in, err := fs.lookup(d, name)
	if err != nil {
		return guestfs.Stat{}, err
	}
	return fs.stat(in), nil
}

// lookup finds name in dir: through the hash index where there is one
// that can be used, else through the names of the directory read into a
// map (dirindex.go), else entry by entry.
func (fs *FS) lookup(dir *inode, name string) (*inode, error) {
	if err := fs.checkDirReadable(dir); err != nil {
		return nil, err
	}
	if name == "" || len(name) > maxNameLen || strings.ContainsAny(name, "/\x00") {
		return nil, fmt.Errorf("%q in directory inode %d: %w", name, dir.ino, iofs.ErrNotExist)
	}
	if name == "." {
		return dir, nil
	}
	var (
		ino    uint32
		found  bool
		usable bool
		err    error
	)
	if fs.isDx(dir) && name != ".." {
		ino, found, usable, err = fs.lookupDx(dir, name)
	}
	if err == nil && !usable && name != ".." && dir.flags&flagInlineData == 0 && fs.dirBlocks(dir) > 1 {
		ino, found, usable, err = fs.lookupIndexed(dir, name)
	}
	if err == nil && !usable {
		ino, found, err = fs.lookupLinear(dir, name)
	}
	if err != nil {
		return nil, err
	}
	if !found {
		return nil, fmt.Errorf("%q in directory inode %d: %w", name, dir.ino, iofs.ErrNotExist)
	}
	return fs.readInode(uint64(ino))
}

// ReadDirIno lists directory dir, without "." and "..", in the order the
// entries are stored.
func (fs *FS) ReadDirIno(dir uint64) ([]guestfs.DirEntry, error) {
	d, err := fs.readInode(dir)
	if err != nil {
		return nil, err
	}
	return fs.readDir(d)
}

// ReadLinkIno returns symbolic link ino's target, as stored.
func (fs *FS) ReadLinkIno(ino uint64) (string, error) {
	in, err := fs.readInode(ino)
	if err != nil {
		return "", err
	}
	return fs.readLink(in)
}

// OpenIno opens inode ino: a regular file, or a device node, FIFO or
// socket as an empty file.
func (fs *FS) OpenIno(ino uint64) (guestfs.File, error) {
	in, err := fs.readInode(ino)
	if err != nil {
		return nil, err
	}
	return fs.openInode(in, "")
}

func (fs *FS) openInode(in *inode, name string) (*file, error) {
	switch in.fileType() {
	case unix.S_IFDIR:
		return nil, fmt.Errorf("%s: inode %d: %w", fs.typ, in.ino, syscall.EISDIR)
	case unix.S_IFLNK:
		return nil, fmt.Errorf("%s: inode %d: a symbolic link: %w", fs.typ, in.ino, syscall.ELOOP)
	case unix.S_IFREG:
		if in.flags&flagEncrypt != 0 {
			return nil, &guestfs.UnsupportedError{Type: fs.typ, Msg: fmt.Sprintf("inode %d: an encrypted file (fscrypt)", in.ino)}
		}
	}
	return &file{fs: fs, in: in, name: name}, nil
}
