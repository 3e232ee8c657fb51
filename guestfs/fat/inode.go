package fat

import (
	"errors"
	"fmt"
	"io/fs"
	"time"

	"github.com/qcowfs/qcowfs/guestfs"
)

// Inode numbers. FAT has no inodes; a file is its short directory entry.
// Its inode number says where that entry is: the directory holding it
// (its key: 0 for the root, else its first cluster) and the entry's index
// there (under 65536, maxDirBytes), as (key+1)<<16 | index. The root is
// 1, Linux's MSDOS_ROOT_INO. A number is stable for as long as the file
// system is not written, and decodes without any table that grows with
// the tree, so a FUSE server can use it as its node ID.
const rootIno = 1

func inoOf(key uint32, index int) uint64 { return (uint64(key)+1)<<16 | uint64(index) }

func splitIno(ino uint64) (key uint32, index int, ok bool) {
	k := ino>>16 - 1
	if ino < 1<<16 || k > maxFAT32+firstCluster {
		return 0, 0, false
	}
	return uint32(k), int(ino & 0xFFFF), true
}

func (f *FS) RootIno() uint64 { return rootIno }

// S_IFMT types.
const (
	sIFDIR = 0o040000
	sIFREG = 0o100000
)

// Permissions as a vfat mount shows them by default: uid and gid 0 (the
// mounter's: root's, for a mount by root or at boot), fmask and dmask the
// mounter's umask (022 as a rule), so 0755 for directories and files
// alike; the read-only attribute takes the write bits off a file (not a
// directory: vfat's rodir is off by default). Linux's fat_make_mode.
const (
	dirMode      = sIFDIR | 0o755
	fileMode     = sIFREG | 0o755
	readOnlyMode = sIFREG | 0o555
)

// stat is the inode of entry e (inode ino); sub is the directory it is,
// for a directory. Linux's fat_fill_inode: size from the entry (a
// directory's from its chain), blocks the size rounded up to whole
// clusters, nlink 1 for a file and fat_subdirs for a directory, mtime
// and ctime the write time, atime the access date, btime the creation
// time.
func (f *FS) stat(ino uint64, e *dirent, sub *dirData) guestfs.Stat {
	st := guestfs.Stat{Ino: ino, Nlink: 1, Mode: fileMode, Size: int64(e.FileSize)}
	if e.Attr&attrReadOnly != 0 {
		st.Mode = readOnlyMode
	}
	if sub != nil {
		st.Mode, st.Size, st.Nlink = dirMode, sub.size, uint32(sub.pd.subdirs)
	}
	st.Blocks = (st.Size + f.g.clusterSize - 1) / f.g.clusterSize * f.g.clusterSize / 512
	st.Mtime = fatTime(e.WrtTime, e.WrtDate, 0)
	st.Ctime = st.Mtime
	st.Atime = fatTime(0, e.LstAccDate, 0)
	st.Btime = fatTime(e.CrtTime, e.CrtDate, e.CrtTimeTenth)
	return st
}

// rootStat is Linux's fat_read_root: times 0, nlink the subdirectories
// and 2, the size that of the root region or of the FAT32 root's chain.
func (f *FS) rootStat() (guestfs.Stat, error) {
	d, err := f.dir(rootKey)
	if err != nil {
		return guestfs.Stat{}, err
	}
	t := time.Unix(0, 0).UTC()
	st := guestfs.Stat{Ino: rootIno, Mode: dirMode, Nlink: uint32(d.pd.subdirs) + 2, Size: d.size,
		Atime: t, Mtime: t, Ctime: t, Btime: t}
	st.Blocks = (st.Size + f.g.clusterSize - 1) / f.g.clusterSize * f.g.clusterSize / 512
	return st, nil
}

// StatIno returns the inode ino.
func (f *FS) StatIno(ino uint64) (guestfs.Stat, error) {
	if ino == rootIno {
		return f.rootStat()
	}
	key, e, err := f.entry(ino)
	if err != nil {
		return guestfs.Stat{}, err
	}
	var sub *dirData
	if e.isDir() {
		if sub, err = f.subdir(key, e, ino); err != nil {
			return guestfs.Stat{}, err
		}
	}
	return f.stat(ino, e, sub), nil
}

// dirOf returns the directory that inode ino is, with its key.
func (f *FS) dirOf(ino uint64) (uint32, *dirData, error) {
	if ino == rootIno {
		d, err := f.dir(rootKey)
		return rootKey, d, err
	}
	key, e, err := f.entry(ino)
	if err != nil {
		return 0, nil, err
	}
	if !e.isDir() {
		return 0, nil, fmt.Errorf("vfat: inode %d: %w", ino, errNotDir)
	}
	d, err := f.subdir(key, e, ino)
	return e.FstClus, d, err
}

var (
	errNotDir   = errors.New("not a directory")
	errIsDir    = errors.New("is a directory")
	errNotLink  = errors.New("not a symbolic link (FAT has none)")
	errNotFound = fs.ErrNotExist
)

// Lookup finds name in directory dir as Linux's vfat_lookup does: the
// first entry, in directory order, whose short or long name equals name
// but for the case of ASCII letters.
func (f *FS) Lookup(dir uint64, name string) (guestfs.Stat, error) {
	key, d, err := f.dirOf(dir)
	if err != nil {
		return guestfs.Stat{}, err
	}
	l := d.byName[fold(name)]
	if len(l) == 0 || badName(name) != "" {
		return guestfs.Stat{}, fmt.Errorf("vfat: %q in inode %d: %w", name, dir, errNotFound)
	}
	e := &d.pd.entries[l[0]]
	ino := inoOf(key, e.index)
	var sub *dirData
	if e.isDir() {
		if sub, err = f.subdir(key, e, ino); err != nil {
			return guestfs.Stat{}, err
		}
	}
	return f.stat(ino, e, sub), nil
}

// ReadDirIno lists directory dir in directory order, "." and ".." left
// out. An entry whose name no Linux listing hands out (doc.go) fails the
// listing, with the entries before it.
func (f *FS) ReadDirIno(dir uint64) ([]guestfs.DirEntry, error) {
	key, d, err := f.dirOf(dir)
	if err != nil {
		return nil, err
	}
	out := make([]guestfs.DirEntry, 0, len(d.pd.entries))
	for i := range d.pd.entries {
		e := &d.pd.entries[i]
		ino := inoOf(key, e.index)
		if why := badName(e.name()); why != "" {
			return out, &guestfs.FormatError{FS: fsType, Inode: ino, Field: "name", Value: uint64(len(e.name())),
				Msg: fmt.Sprintf("%q %s: no listing can show it", e.name(), why)}
		}
		t := uint32(sIFREG)
		if e.isDir() {
			t = sIFDIR
		}
		out = append(out, guestfs.DirEntry{Name: e.name(), Ino: ino, Type: t})
	}
	return out, nil
}

// ReadLinkIno: FAT has no symbolic links.
func (f *FS) ReadLinkIno(ino uint64) (string, error) {
	if _, err := f.StatIno(ino); err != nil {
		return "", err
	}
	return "", fmt.Errorf("vfat: inode %d: %w", ino, errNotLink)
}
