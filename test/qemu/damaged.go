package qemu

import (
	"path/filepath"
	"testing"
)

// Damaged makes, in dir, images that qemu-img check finds damaged, one
// kind of damage each (the name says which), from images qemu made and
// one field patched: refcounts one off, an L2 entry pointing into the L1
// table or (COPIED) into the refcount table, two L2 entries sharing a
// cluster (with 16-bit refcounts, and with 1-bit ones, which overflow),
// an L2 table past the end of the file, a compressed cluster with COPIED
// set, an unallocated extended L2 entry with allocated subclusters.
func Damaged(t testing.TB, dir string) []Image {
	t.Helper()
	const cs = 65536
	// mk creates the image name with qemu, writes cmds and returns its
	// path.
	mk := func(name string, opts []string, cmds ...string) string {
		p := filepath.Join(dir, name+".qcow2")
		Create(t, "qcow2", p, "8M", opts...)
		IO(t, p, cmds...)
		return p
	}
	std := []string{"write -P 0x51 0 256k", "write -P 0x52 1M 64k"}
	var out []Image
	add := func(name, p string) { out = append(out, Image{Name: name, Path: p}) }

	p := mk("refcount-decremented", nil, std...)
	_, e := L2EntryOffset(t, p, 0)
	at := RefcountEntryOffset(t, p, int64(e&OffsetMask)/cs)
	PatchU(t, p, at, 2, ReadU(t, p, at, 2)-1)
	add("refcount-decremented", p)

	p = mk("refcount-incremented", nil, std...)
	_, e = L2EntryOffset(t, p, 1)
	at = RefcountEntryOffset(t, p, int64(e&OffsetMask)/cs)
	PatchU(t, p, at, 2, ReadU(t, p, at, 2)+1)
	add("refcount-incremented", p)

	p = mk("l2-into-l1", nil, std...)
	at, e = L2EntryOffset(t, p, 2)
	PatchU(t, p, at, 8, e&^OffsetMask|ReadU(t, p, HeaderL1TableOffset, 8))
	add("l2-into-l1", p)

	// Guest cluster 0's data is the refcount table's cluster, COPIED
	// kept: a write there would go in place, over the table.
	p = mk("l2-into-reftable", nil, std...)
	at, e = L2EntryOffset(t, p, 0)
	PatchU(t, p, at, 8, e&^OffsetMask|ReadU(t, p, HeaderRefcountTableOffset, 8))
	add("l2-into-reftable", p)

	p = mk("shared-cluster", nil, std...)
	_, e = L2EntryOffset(t, p, 0)
	at, _ = L2EntryOffset(t, p, 3)
	PatchU(t, p, at, 8, e)
	add("shared-cluster", p)

	// With 1-bit refcounts, a second reference overflows the count.
	p = mk("refcount-overflow", []string{"-o", "refcount_bits=1"}, std...)
	_, e = L2EntryOffset(t, p, 0)
	at, _ = L2EntryOffset(t, p, 1)
	PatchU(t, p, at, 8, e)
	add("refcount-overflow", p)

	// The L2 table 1 TiB past the end of the file.
	p = mk("table-past-eof", nil, std...)
	PatchU(t, p, int64(ReadU(t, p, HeaderL1TableOffset, 8)), 8, 1<<63|1<<40)
	add("table-past-eof", p)

	p = mk("compressed-copied", nil, "write -c -P 0x53 0 64k")
	at, e = L2EntryOffset(t, p, 0)
	PatchU(t, p, at, 8, e|1<<63)
	add("compressed-copied", p)

	// Extended L2: entries are 16 bytes, the subcluster bitmap second;
	// guest cluster 3 is unallocated, and gets an "allocated" bit.
	p = mk("unallocated-subclusters", []string{"-o", "extended_l2=on"}, "write -P 0x54 0 64k")
	l2 := int64(ReadU(t, p, int64(ReadU(t, p, HeaderL1TableOffset, 8)), 8) & OffsetMask)
	PatchU(t, p, l2+3*16+8, 8, 1)
	add("unallocated-subclusters", p)
	return out
}
