package fs

import (
	"log/slog"
	"os"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// A mount must never wait on itself. The daemon opens files of its own
// while it serves (backing files, key files, overlays, the disk cache);
// if one of them lies inside the mount point, its open is a request to
// the daemon, made while the request that opened it holds what the new
// one needs (a folder's scan, an image being opened), and neither ever
// ends: every process that touches the mount hangs with it, beyond kill
// -9, until the connection is aborted. The command refuses the folders
// it is told about (cmd/qcowfs/ownpaths.go), but a path can still lead
// there: a backing file name an image holds (/mnt/vms/other.raw), a
// symlink, a bind mount of the mount point. So a request that enters the
// mount by a name or a node (LOOKUP, OPEN, GETATTR of anything but the
// root, ...) and comes from one of the daemon's own threads fails at once
// with EDEADLK, and says so in the log. (stat of the mount point itself,
// the root's GETATTR, is answered: it takes no lock, and the daemon stats
// it to find the mount's device.)
//
// The kernel gives a request the thread ID of its caller
// (fuse_in_header.pid); tgkill(our PID, that ID, 0) succeeds exactly for
// our own threads. It is one system call, on the requests above only.

// selfGuard refuses the daemon's own requests on its mount.
type selfGuard struct {
	fuse.RawFileSystem
	pid    int
	log    *slog.Logger
	logged atomic.Int64 // unix nanoseconds of the last log line
}

func newSelfGuard(fs fuse.RawFileSystem, log *slog.Logger) *selfGuard {
	return &selfGuard{RawFileSystem: fs, pid: os.Getpid(), log: log}
}

// selfRefused is the reply to a request of the daemon's own.
const selfRefused = fuse.Status(syscall.EDEADLK)

// ours reports whether the request h comes from one of our threads, and
// logs it (at most once a minute).
func (g *selfGuard) ours(h *fuse.InHeader, op, name string) bool {
	if h.Caller.Pid == 0 || unix.Tgkill(g.pid, int(h.Caller.Pid), 0) != nil {
		return false
	}
	now := time.Now().UnixNano()
	last := g.logged.Load()
	if now-last >= int64(time.Minute) && g.logged.CompareAndSwap(last, now) {
		g.log.Error("a request of the daemon's own on its mount was refused (EDEADLK): something the daemon reads or writes for itself (a backing file, a key, its cache, an overlay) lies inside the mount point, where serving it would wait on itself",
			"op", op, "node", h.NodeId, "name", name)
	}
	return true
}

func (g *selfGuard) Lookup(cancel <-chan struct{}, h *fuse.InHeader, name string, out *fuse.EntryOut) fuse.Status {
	if g.ours(h, "LOOKUP", name) {
		return selfRefused
	}
	return g.RawFileSystem.Lookup(cancel, h, name, out)
}

func (g *selfGuard) GetAttr(cancel <-chan struct{}, in *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	if in.NodeId != fuse.FUSE_ROOT_ID && g.ours(&in.InHeader, "GETATTR", "") {
		return selfRefused
	}
	return g.RawFileSystem.GetAttr(cancel, in, out)
}

func (g *selfGuard) Statx(cancel <-chan struct{}, in *fuse.StatxIn, out *fuse.StatxOut) fuse.Status {
	if in.NodeId != fuse.FUSE_ROOT_ID && g.ours(&in.InHeader, "STATX", "") {
		return selfRefused
	}
	return g.RawFileSystem.Statx(cancel, in, out)
}

func (g *selfGuard) SetAttr(cancel <-chan struct{}, in *fuse.SetAttrIn, out *fuse.AttrOut) fuse.Status {
	if g.ours(&in.InHeader, "SETATTR", "") {
		return selfRefused
	}
	return g.RawFileSystem.SetAttr(cancel, in, out)
}

func (g *selfGuard) Open(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	if g.ours(&in.InHeader, "OPEN", "") {
		return selfRefused
	}
	return g.RawFileSystem.Open(cancel, in, out)
}

func (g *selfGuard) OpenDir(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	if g.ours(&in.InHeader, "OPENDIR", "") {
		return selfRefused
	}
	return g.RawFileSystem.OpenDir(cancel, in, out)
}

func (g *selfGuard) Create(cancel <-chan struct{}, in *fuse.CreateIn, name string, out *fuse.CreateOut) fuse.Status {
	if g.ours(&in.InHeader, "CREATE", name) {
		return selfRefused
	}
	return g.RawFileSystem.Create(cancel, in, name, out)
}

func (g *selfGuard) Mknod(cancel <-chan struct{}, in *fuse.MknodIn, name string, out *fuse.EntryOut) fuse.Status {
	if g.ours(&in.InHeader, "MKNOD", name) {
		return selfRefused
	}
	return g.RawFileSystem.Mknod(cancel, in, name, out)
}

func (g *selfGuard) Mkdir(cancel <-chan struct{}, in *fuse.MkdirIn, name string, out *fuse.EntryOut) fuse.Status {
	if g.ours(&in.InHeader, "MKDIR", name) {
		return selfRefused
	}
	return g.RawFileSystem.Mkdir(cancel, in, name, out)
}

func (g *selfGuard) Unlink(cancel <-chan struct{}, h *fuse.InHeader, name string) fuse.Status {
	if g.ours(h, "UNLINK", name) {
		return selfRefused
	}
	return g.RawFileSystem.Unlink(cancel, h, name)
}

func (g *selfGuard) Rename(cancel <-chan struct{}, in *fuse.RenameIn, oldName, newName string) fuse.Status {
	if g.ours(&in.InHeader, "RENAME", oldName) {
		return selfRefused
	}
	return g.RawFileSystem.Rename(cancel, in, oldName, newName)
}

func (g *selfGuard) Readlink(cancel <-chan struct{}, h *fuse.InHeader) ([]byte, fuse.Status) {
	if g.ours(h, "READLINK", "") {
		return nil, selfRefused
	}
	return g.RawFileSystem.Readlink(cancel, h)
}

func (g *selfGuard) Access(cancel <-chan struct{}, in *fuse.AccessIn) fuse.Status {
	if g.ours(&in.InHeader, "ACCESS", "") {
		return selfRefused
	}
	return g.RawFileSystem.Access(cancel, in)
}

func (g *selfGuard) GetXAttr(cancel <-chan struct{}, h *fuse.InHeader, attr string, dest []byte) (uint32, fuse.Status) {
	if g.ours(h, "GETXATTR", attr) {
		return 0, selfRefused
	}
	return g.RawFileSystem.GetXAttr(cancel, h, attr, dest)
}
