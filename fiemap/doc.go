// Package fiemap answers, for a host file, "where does this file hold data,
// and where are its holes?", the way lseek(2) SEEK_DATA and SEEK_HOLE do,
// but asking the kernel as few times as possible.
//
// It owns nothing of qcow2 or FUSE: a [Map] wraps one open regular file and
// answers [Map.NextData], [Map.NextHole] and [Map.Data] from a bounded cache
// of the file's extents, asking the host only for regions it has not seen.
// qcowfs uses it to find clusters that an image's metadata calls allocated
// but whose host bytes were never written (images made with
// `qemu-img create -o preallocation=metadata` or `=falloc`): they read as
// zeros and are reported as holes to SEEK_DATA/SEEK_HOLE callers.
//
// # FIEMAP versus SEEK_DATA
//
// lseek(SEEK_DATA/SEEK_HOLE) reports one boundary per call, so walking a file
// of n extents costs 2n system calls, and it moves the file offset, which
// concurrent callers share. The FS_IOC_FIEMAP ioctl
// (Documentation/filesystems/fiemap.rst) returns up to fm_extent_count
// extents of a byte range in one call and touches no offset; a Map asks for
// [Options.WindowExtents] extents (256 by default) from the queried offset to
// the next region already cached (or end of file), so a fragmented file is
// walked with one call per 256 extents and a 1 TiB file that is almost all
// hole with a single call. The window is bounded by extents, not bytes: the
// kernel's cost is per extent returned, and a byte bound would turn a walk of
// a huge sparse file into thousands of calls.
//
// FIEMAP is a per-filesystem operation. tmpfs, for one, does not implement it
// (EOPNOTSUPP; other filesystems answer ENOTTY, EINVAL or ENOSYS). Then a Map
// falls back to lseek(SEEK_DATA/SEEK_HOLE), on a private open file
// description (a reopen of /proc/self/fd/N: a dup(2) would share the file
// offset) when it can get one. If lseek does not work either, every byte is
// reported as data, which is always a correct, if pessimistic, answer.
// [Stats.Method] says which method a Map settled on.
//
// # Unwritten and delayed-allocation extents
//
// An extent flagged FIEMAP_EXTENT_UNWRITTEN has disk blocks reserved (by
// fallocate(2), or `qemu-img -o preallocation=falloc`) but never written: it
// reads as zeros, so it is a hole, as ext4's and xfs's own SEEK_DATA say.
// FIEMAP_EXTENT_DELALLOC is the opposite case: data written into the page
// cache whose blocks the filesystem has not allocated yet; it is data.
//
// With Options.Sync the ioctl is called with FIEMAP_FLAG_SYNC, which writes
// the file's dirty pages back first; an unwritten extent is then a hole,
// full stop. Without it a Map causes no writeback, which has a catch, seen
// on ext4 (kernel 6.18): a buffered
// write into an unwritten extent leaves the extent flagged unwritten until
// writeback converts it, up to dirty_expire_centisecs (30 s) later, while the
// data sits in dirty pages and read(2) returns it. FIEMAP reports such an
// extent as unwritten, lseek(SEEK_DATA) (iomap_seek_data, which looks at the
// page cache inside unwritten extents) as data. So a Map checks every
// unwritten extent it meets with lseek(SEEK_DATA) over the extent's range:
// usually one call that confirms the hole, and the dirty (or cached) pages
// as data when there are any. Pages that are merely cached clean over an
// unwritten extent (somebody read the zeros) count as data too; that costs
// only a missed hole, never wrong bytes.
//
// # Caching
//
// The file must not change while it is mapped: answers are cached for the
// life of the Map. The cache is a sorted set of disjoint windows, each a
// byte range the host has described in full, holding the sorted data extents
// inside it; a query is a binary search for the window, then one for the
// extent (O(log n)). A region is asked of the host at most once while it
// stays cached: a miss asks only for the gap between cached windows, and
// concurrent misses are serialized so they do not ask twice. Memory is
// bounded by [Options.CacheExtents] (each cached extent costs 16 bytes, each
// window about 64 more); beyond it, windows are evicted in CLOCK (second
// chance) order, so regions queried again recently survive. [Map.Stats]
// counts the host calls, which callers report as host calls per copy.
package fiemap
