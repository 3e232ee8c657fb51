package fs

import (
	"context"
	"errors"
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
// overlapping another) is not shown, and a line is logged, once per disk.
// Tables are read once per disk version and cached.

// tableOrError is a cached partition table read, or why there is none.
type tableOrError struct {
	table *partition.Table
	err   error
}

// partitionTable returns the partition table of disk d of the image at
// path, reading it on first use; nil if the disk has none.
func (m *mount) partitionTable(path string, d diskID) *partition.Table {
	d = d.base()
	m.tablesMu.Lock()
	t, ok := m.tables[d]
	m.tablesMu.Unlock()
	if ok {
		return t.table
	}
	t = &tableOrError{}
	oi, err := m.acquire(path, d)
	if err == nil {
		t.table, t.err = partition.Read(oi.img, oi.img.Size(), 0)
		m.release(d, oi)
	} else {
		t.err = err
	}
	what := describe(path, d)
	switch {
	case errors.Is(t.err, partition.ErrNoTable):
	case t.err != nil:
		m.log.Warn("partition table not shown", "disk", what, "reason", t.err.Error())
	default:
		for _, w := range t.table.Warnings {
			m.log.Warn("partition table", "disk", what, "warning", w)
		}
	}
	m.tablesMu.Lock()
	if len(m.tables) >= maxUsageEntries {
		clear(m.tables)
	}
	m.tables[d] = t
	m.tablesMu.Unlock()
	return t.table
}

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

// partsNode is the folder of one disk's partitions.
type partsNode struct {
	gofs.Inode
	m     *mount
	path  string
	d     diskID // the whole disk
	table *partition.Table
	img   *entry // the disk's entry, for owner, times and permissions
}

var (
	_ = (gofs.NodeLookuper)((*partsNode)(nil))
	_ = (gofs.NodeReaddirer)((*partsNode)(nil))
	_ = (gofs.NodeGetattrer)((*partsNode)(nil))
)

func partName(p partition.Partition) string { return "p" + strconv.Itoa(p.Number) }

// partEntry is the entry of partition p, for attributes.
func (n *partsNode) partEntry(p partition.Partition) *entry {
	d := n.d
	d.part = p.Number
	e := *n.img
	e.kind, e.snap, e.part = kindImage, d.snap, d.part
	e.size, e.used = p.Size, min(n.img.used, p.Size)
	return &e
}

func (n *partsNode) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	num, err := strconv.Atoi(strings.TrimPrefix(name, "p"))
	if !strings.HasPrefix(name, "p") || err != nil {
		return nil, syscall.ENOENT
	}
	for _, p := range shownPartitions(n.table) {
		if p.Number != num {
			continue
		}
		e := n.partEntry(p)
		node := &imageNode{m: n.m, path: n.path, d: e.disk(), start: p.Start, size: p.Size, used: e.used}
		n.m.usage.request(e.disk(), usageJob{path: n.path, start: p.Start, end: p.Start + p.Size})
		child := n.NewInode(ctx, node, gofs.StableAttr{Mode: syscall.S_IFREG, Ino: e.disk().inode(), Gen: e.v.generation()})
		n.m.usage.watch(e.disk(), child)
		if n.m.fillAttr(&out.Attr, e) {
			out.SetAttrTimeout(imageAttrTimeout)
		}
		return child, 0
	}
	return nil, syscall.ENOENT
}

func (n *partsNode) Readdir(ctx context.Context) (gofs.DirStream, syscall.Errno) {
	var list []fuse.DirEntry
	for _, p := range shownPartitions(n.table) {
		list = append(list, fuse.DirEntry{Name: partName(p), Mode: syscall.S_IFREG, Ino: n.partEntry(p).disk().inode()})
	}
	return gofs.NewListDirStream(list), 0
}

func (n *partsNode) Getattr(ctx context.Context, f gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	e := *n.img
	e.kind = kindParts
	n.m.fillAttr(&out.Attr, &e)
	return 0
}

// partsName is the folder name for the partitions of the file shown as
// name.
func partsName(name string) string { return name + ".parts" }

// describe is how a log line names a disk.
func describe(path string, d diskID) string {
	if d.snap == "" {
		return path
	}
	return fmt.Sprintf("%s snapshot %s", path, d.snap)
}
