package fs

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/qcowfs/qcowfs/partition"
)

// Guest partitions as files.
//
// A disk (an image or a snapshot) whose first sectors hold an MBR or GPT
// partition table gets a read-only folder beside its file, STEM.raw.parts,
// with one file per partition, p1, p2, ... numbered as the kernel numbers
// them (extended MBR containers are not shown). Each is exactly the
// partition's byte range of the disk, with holes and st_blocks like the
// disk's. A partition the table gets wrong (past the end of the disk,
// overlapping another) is not shown, and a line is logged, once per disk
// version. Tables are read when the image is validated (scan.go), and
// again when a writer of the disk closes or fsyncs it (tableWritten).

// shownPartitions are the partitions of t that get a file.
func shownPartitions(t *partition.Table) []partition.Partition {
	var out []partition.Partition
	for _, p := range t.Partitions {
		if !p.Extended && p.Size > 0 {
			out = append(out, p)
		}
	}
	return out
}

// shownTable is t if a partition of it gets a file, else nil.
func shownTable(t *partition.Table) *partition.Table {
	if t == nil || len(shownPartitions(t)) == 0 {
		return nil
	}
	return t
}

// layout is what a partitions folder shows of table t: each shown
// partition's number and byte range; "" for none.
func layout(t *partition.Table) string {
	if t == nil {
		return ""
	}
	var b strings.Builder
	for _, p := range shownPartitions(t) {
		fmt.Fprintf(&b, "%d:%d+%d,", p.Number, p.Start, p.Size)
	}
	return b.String()
}

// A table written through the mount. A folder's scan keeps the table each
// disk had when validated, and a lookup checks only the entry behind the
// name it looks up, so DISK.raw.parts, named after the disk, would appear
// at the next listing only, and a removed table's folder would stay in
// the kernel's cache of names until it expired. So a writer's close or
// fsync (after writes) reads the table again, and a changed one is shown
// at once.

// tableWritten reads the disk's partition table, if the disk was written
// since it was last read, and has the folder that shows the disk take it;
// if the partitions folder changed, the kernel drops its name, so that the
// next lookup finds the new table, or none. oi is the open disk.
func (n *imageNode) tableWritten(oi *openImage) {
	w := oi.writes.Load()
	if n.m.cfg.NoPartitions || oi.tableRead.Swap(w) == w {
		return
	}
	dir, name := n.shownIn()
	if dir == nil {
		return
	}
	t, err := partitionsOf(oi.image())
	if parts := dir.takeTable(name, shownTable(t)); parts != "" {
		n.m.logTable(t, err, oi.imagePath())
		dir.RmChild(parts)
		dir.NotifyEntry(parts)
	}
}

// shownIn returns the folder that shows the node's disk, and the disk's
// name there (a partition's disk is named after its partitions folder);
// nil if the node left the tree.
func (n *imageNode) shownIn() (*dirNode, string) {
	name, parent := n.Parent()
	if parent != nil && n.part != 0 {
		name, parent = parent.Parent()
		name = strings.TrimSuffix(name, partsSuffix)
	}
	if parent == nil {
		return nil, ""
	}
	if f, ok := parent.Operations().(interface{ folder() *dirNode }); ok {
		return f.folder(), name
	}
	return nil, ""
}

// partsNode is the folder of one disk's partitions.
type partsNode struct {
	gofs.Inode
	noXattrs
	m    *mount
	disk *shown // the partitions folder as listed: its entry, snapshot and table
}

var (
	_ = (gofs.NodeLookuper)((*partsNode)(nil))
	_ = (gofs.NodeReaddirer)((*partsNode)(nil))
	_ = (gofs.NodeGetattrer)((*partsNode)(nil))
)

func partName(p partition.Partition) string { return "p" + strconv.Itoa(p.Number) }

// partition returns what partition p of the disk shows as.
func (n *partsNode) partition(p partition.Partition) *shown {
	x := *n.disk
	x.part, x.table, x.start, x.size = p.Number, nil, p.Start, p.Size
	return &x
}

func (n *partsNode) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	num, err := strconv.Atoi(strings.TrimPrefix(name, "p"))
	if !strings.HasPrefix(name, "p") || err != nil {
		return nil, syscall.ENOENT
	}
	for _, p := range shownPartitions(n.disk.table) {
		if p.Number != num {
			continue
		}
		x := n.partition(p)
		whole := *n.disk
		whole.part, whole.table = 0, nil
		node := &imageNode{m: n.m, x: &whole, part: p.Number, start: p.Start, size: p.Size}
		n.m.usage.request(x.disk(), usageJob{rel: x.e.rel, start: p.Start, end: p.Start + p.Size})
		child := n.NewInode(ctx, node, gofs.StableAttr{Mode: syscall.S_IFREG, Ino: x.disk().inode(), Gen: n.m.nodeGen(x)})
		n.m.usage.watch(x.disk(), child)
		if n.m.fillAttr(&out.Attr, x) {
			out.SetAttrTimeout(imageAttrTimeout)
		}
		return child, 0
	}
	return nil, syscall.ENOENT
}

func (n *partsNode) Readdir(ctx context.Context) (gofs.DirStream, syscall.Errno) {
	var list []fuse.DirEntry
	for _, p := range shownPartitions(n.disk.table) {
		list = append(list, fuse.DirEntry{Name: partName(p), Mode: syscall.S_IFREG, Ino: n.partition(p).disk().inode()})
	}
	return gofs.NewListDirStream(list), 0
}

func (n *partsNode) Getattr(ctx context.Context, f gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	n.m.fillAttr(&out.Attr, n.disk)
	return 0
}

// partsName is the folder name for the partitions of the file shown as
// name.
func partsName(name string) string { return name + partsSuffix }

const partsSuffix = ".parts"

// describe is how a log line names a disk.
func describe(path string, snapID string) string {
	if snapID == "" {
		return path
	}
	return fmt.Sprintf("%s snapshot %s", path, snapID)
}
