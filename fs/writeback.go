package fs

import (
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// A write past the end of a disk, with the kernel's writeback cache.
//
// A disk never grows by being written past its end: the part of a write
// that fits is written and the rest fails with ENOSPC. Without the
// writeback cache the kernel sends each write(2) on, and the write returns
// the bytes that fit, as on a block device (imageHandle.Write); the next
// one fails. With FUSE_WRITEBACK_CACHE a buffered write(2) lands in the
// kernel's page cache whole, past the end too, and reaches us later, when
// the kernel writes the pages back (a WRITE flagged FUSE_WRITE_CACHE).
// Two things then differ from a disk:
//
//   - The kernel takes a short count of a page-cache write for the whole
//     write done and drops the rest without an error. Such a write fails
//     with ENOSPC instead, after what fits is written (cachedWrites); the
//     kernel keeps the error for the next fsync, or close without one.
//     The kernel may write pages back through any handle open for
//     writing, an O_DIRECT one too, so the flag, not the handle, tells a
//     page-cache write from a write(2).
//   - The kernel owns the size of a file it caches writes for: it grew
//     the file by the overhang and ignores the size in our replies for as
//     long as the inode lives, which is until the last opener closes and
//     the kernel's RELEASE (sent after close returns) is done, or longer
//     if a name still points at it. No notification sets it (an inode
//     notification drops cached attributes and pages, not the size). So
//     the node is replaced (imageNode.replace): its name is dropped, and
//     the next lookup makes a new node (identity.go), a new inode for the
//     kernel, with the disk's size. The files open on the old node keep
//     it, and the size the kernel gave it, until they close; the two
//     nodes do not share the kernel's page cache, as a disk and its
//     partitions do not.

// Mount mounts root at dir, as go-fuse's fs.Mount does, with the node
// file system wrapped in cachedWrites, the self guard (selfguard.go) and,
// for a writable mount, kindsFS (requests.go), and returns the serving
// server. afterInit, if not nil, runs once the kernel's INIT is answered
// and before the mount is used (a FUSE-over-io_uring transport registers
// its rings then: uring.go); an error from it unmounts.
func Mount(dir string, root *Root, opts *gofs.Options, afterInit func(*fuse.Server) error) (*fuse.Server, error) {
	nodes := gofs.NewNodeFS(root, opts)
	if root.m.cfg.Writable {
		nodes = kindsFS{nodes, &root.m.kinds}
	}
	var raw fuse.RawFileSystem = cachedWrites{nodes}
	if !root.m.inProcess {
		raw = newSelfGuard(raw, root.m.log)
	}
	server, err := fuse.NewServer(raw, dir, &opts.MountOptions)
	if err != nil {
		return nil, err
	}
	go server.Serve()
	if afterInit != nil {
		if err := afterInit(server); err != nil {
			server.Unmount()
			return nil, err
		}
	}
	if err := server.WaitMount(); err != nil {
		return nil, err
	}
	return server, nil
}

// cachedWrites turns a short count of a page-cache write into ENOSPC: a
// write is short only at the end of a disk (imageHandle.Write).
type cachedWrites struct{ fuse.RawFileSystem }

func (c cachedWrites) Write(cancel <-chan struct{}, in *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	n, st := c.RawFileSystem.Write(cancel, in, data)
	return n, cachedStatus(in, n, st)
}

// Writev is what go-fuse's server calls for a WRITE.
func (c cachedWrites) Writev(cancel <-chan struct{}, in *fuse.WriteIn, data [][]byte) (uint32, fuse.Status) {
	n, st := c.RawFileSystem.Writev(cancel, in, data)
	return n, cachedStatus(in, n, st)
}

func cachedStatus(in *fuse.WriteIn, n uint32, st fuse.Status) fuse.Status {
	if st == fuse.OK && n < in.Size && in.WriteFlags&fuse.WRITE_CACHE != 0 {
		return fuse.Status(syscall.ENOSPC)
	}
	return st
}

// replace replaces the node, once, after a write past its end came: with
// the writeback cache, maybe the writeback of a write(2) that grew the
// kernel's size of the file (an O_DIRECT write past the end, which did
// not, replaces it too, needlessly but harmlessly). The name is dropped
// from the kernel's cache before the write is answered, so the writer's
// fsync or close, which wait for that answer, return with the name gone,
// and the next lookup makes the new node. (The notification is safe to
// send from the write: the kernel locks the parent folder for it, which
// nothing holds while waiting for a writeback.)
func (n *imageNode) replace() {
	if n.replaced.Swap(true) {
		return
	}
	n.m.ids.replace(n.disk())
	if name, parent := n.Parent(); parent != nil {
		parent.RmChild(name)
		parent.NotifyEntry(name)
	}
}
