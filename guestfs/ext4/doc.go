// Package ext4 reads ext2, ext3 and ext4 file systems, read-only, as a
// guestfs.FS (io/fs, plus calls by inode number), from an io.ReaderAt of
// the partition. It is written to the on-disk format as the kernel's
// Documentation/filesystems/ext4/ describes it and as fs/ext4 and
// fs/jbd2 read it; e2fsprogs (mkfs.ext4 -d, debugfs, e2fsck) and the
// kernel's own mount of the same image are the tests' oracles. It knows
// nothing of qcow2 or FUSE, and registers itself with guestfs.Open for
// "ext2", "ext3" and "ext4".
//
// # What it reads
//
// Everything Debian's mkfs.ext4 makes by default (extents, 64bit,
// metadata_csum, flex_bg, huge_file, dir_nlink, extra_isize, has_journal,
// sparse_super, filetype, dir_index, resize_inode) and what ext2 and ext3
// make; inline_data, meta_bg, bigalloc, largedir (three-level htrees),
// csum_seed, sparse_super2, mmp. Files mapped by extents (unwritten
// extents read as zeros and are holes to SEEK_HOLE, as on the kernel's
// mount) or by block maps (direct, single, double and triple indirect
// blocks, holes at every level), or held inline; directories linear,
// hashed (lookups go down the hash index: legacy, half-MD4 and TEA, signed
// and unsigned) or inline; fast, slow and inline symbolic links; device
// nodes (both encodings of their numbers), FIFOs, sockets; times to the
// nanosecond with the epoch bits past 2038, creation times, 32-bit owners.
// Not read: encrypted files and directories (fscrypt: an error naming the
// inode), the casefold feature's case-insensitive lookups (a casefolded
// directory is searched by exact name), compression and dirdata (the file
// system is refused, as the kernel refuses it), extended attributes and
// ACLs (not part of guestfs.FS), external journals needing recovery.
//
// # Checksums
//
// With metadata_csum every checksum the kernel checks on the way to a
// file is checked: the superblock's (Open fails), each group descriptor's
// (the inodes of that group fail), each inode's, each extent block's,
// each directory leaf's and htree index block's, and the journal's. A
// mismatch is a *guestfs.FormatError naming the inode and the structure,
// as it is an error (EFSBADCRC) on the kernel's mount. With gdt_csum
// (uninit_bg) the descriptors' CRC-16 is checked. Bitmaps are never read.
//
// # The journal
//
// A file system that needs recovery (a snapshot of a running guest) has
// its journal replayed in memory when it is opened, so that it reads as
// the kernel's read-only mount shows it, which replays the journal first;
// see journal.go for what is and is not replayed. Where the kernel's
// replay would fail, Open fails: the file system is never shown as a mix
// of replayed and unreplayed blocks.
//
// # Hostile images
//
// An image is untrusted. Every field is checked where it is read: block
// numbers against the file system's size (and that against the
// partition's), so nothing outside the partition is ever read; counts
// against what their block can hold; extent trees by depth (each level one
// less than its parent, so no walk can cycle), order and bounds; directory
// entries by record length, name length and inode number; symbolic links
// by length, and path resolution by the kernel's 40 links and by the
// directories already on the path (a directory that holds its own ancestor
// is an error, not an endless path). Memory is bounded: metadata blocks go
// through a cache of fixed size (Options.CacheBytes), linear directories'
// names through an index of at most 2^17 names (dirindex.go); nothing is
// read whole but a directory listed (at most 2^22 entries) and a journal
// replayed (at most 2^21 blocks, a map of them). A malformed structure is
// a *guestfs.FormatError (wrapping guestfs.ErrCorrupt) naming the inode,
// the field and its value; never a panic.
//
// # Why not go-diskfs
//
// github.com/diskfs/go-diskfs has an ext4 package (read and write). As of
// its snapshot of July 2026 (c5b3b50) it does not read what the tests here
// make: files and directories of ext2 and ext3, and any ext4 inode without
// extents (it parses block pointers but reads only extents); holes (its
// File.Read copies extent after extent as if they were contiguous, so a
// file with a hole reads shifted data) and unwritten extents (their length
// is taken with the unwritten bit, and their blocks read as data); inline
// data (files and directories); slow symbolic links (the target is read
// from i_block only when shorter than 60 bytes); a journal that needs
// recovery (no replay; the flag is not looked at); SEEK_DATA and
// SEEK_HOLE. Against hostile images it reads whole directories and files
// into memory at sizes the image states. Fixing those would be most of a
// reader; this package is one, read-only.
package ext4
