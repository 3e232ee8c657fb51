package fs

import (
	"os"
	"syscall"

	"github.com/qcowfs/qcowfs/qcow2"
)

// The source tree: what the user mounted, as the rest of the mount sees it.
// Two kinds implement it: a local folder (source.go), reached through a
// descriptor of its root with openat2, and remote objects (remotetree.go),
// the objects under an s3:// prefix or one http(s):// image, listed through
// package remote. Everything above (scans, identities, the registry, the
// nodes) works on stats: a remote tree makes up stats for its objects and
// folders (a device of its own, an inode number per key, the size, and the
// ETag in the times), so that a replaced object is a changed file and a new
// listing a changed folder, exactly as for local files.
type tree interface {
	// abs names rel in messages: a path, or a redacted URL.
	abs(rel string) string
	// folder opens the folder rel for a scan.
	folder(rel string) (folder, error)
	// stat stats rel, following symlinks inside the tree.
	stat(rel string) (syscall.Stat_t, error)
	// resolveLink returns where the symlink rel points, relative to the
	// root, or an error if that is outside the tree.
	resolveLink(rel string) (string, error)
	// probe reports whether the regular file rel is a qcow2 image, as
	// qemu's probe decides, and whether it begins with qcow2's magic
	// (probeHead): a file with the magic that is no qcow2 image to
	// qemu is one cut short, or damaged, and is logged.
	probe(rel string) (isQcow2, magic bool)
	// openImage opens the image file rel, for writing if write, and
	// returns it with its stat now.
	openImage(rel string, write bool) (qcow2.HostFile, syscall.Stat_t, error)
	// fileStat stats an image file that openImage returned.
	fileStat(f qcow2.HostFile) (syscall.Stat_t, error)
	// showsPlain reports whether regular files that are not qcow2
	// images are shown (as they are); openPlain opens one for reading.
	showsPlain() bool
	openPlain(rel string) (*os.File, error)
	// statfs reports the numbers of the file system holding the tree.
	statfs(st *syscall.Statfs_t) error
	// backingName is the name an overlay records as its backing file
	// for the image file rel (overlay.go): its absolute path, or its
	// URL without credentials; names reports whether an overlay's
	// backing file name names rel.
	backingName(rel string) string
	names(rel, name string) bool
	// configure adjusts the image options for files of this tree: the
	// folders or URL prefixes backing files must lie in, the opener.
	configure(o *qcow2.Options)
	// close lets go of what the tree holds, when the mount is gone.
	close()
}

// A folder is one folder of the tree, open for a scan.
type folder interface {
	// stat stats the folder itself: a new entry, or one gone, changes
	// its version.
	stat() (syscall.Stat_t, error)
	// names lists the folder's entries.
	names() ([]string, error)
	// lstat stats the entry name without following a symlink.
	lstat(name string) (syscall.Stat_t, error)
	Close() error
}
