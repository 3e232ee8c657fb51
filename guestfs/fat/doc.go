// Package fat reads FAT12, FAT16 and FAT32 file systems with VFAT long
// names, as a guestfs.FS, the way Linux's vfat driver shows them with its
// default mount options, from an io.ReaderAt of one partition. It knows
// nothing of qcow2, partitions or FUSE.
//
// What a default vfat mount shows, and so this package (Linux's
// fs/fat/inode.c fat_fill_inode, fat_read_root, dir.c):
//
//   - Owners and modes: uid and gid 0 (the mounter's), fmask and dmask the
//     mounter's umask, taken as 022: directories 0755, files 0755, a file
//     with the read-only attribute 0555 (a directory's read-only
//     attribute is ignored, as with rodir off). Hidden and system
//     attributes change nothing.
//   - Times: mtime and ctime the entry's write time (2 s steps), atime its
//     access date (midnight), btime its creation time (10 ms steps). FAT
//     keeps local time without a zone; Linux shifts it by the kernel's
//     time zone, which is UTC on machines whose hardware clock keeps UTC:
//     times here are read as UTC. The root directory's times are 0.
//   - Sizes: a file's from its entry; a directory's the bytes of its
//     cluster chain (the FAT12/16 root: its fixed region); st_blocks the
//     size rounded up to whole clusters. nlink: 1 for a file; for a
//     directory the entries with the directory bit in it, "." and ".."
//     included (2 plus its subdirectories), for the root its
//     subdirectories plus 2.
//   - Names: the long name when its slots' checksum matches the short
//     entry, else the short name through codepage 437, lower-cased where
//     the entry's NT case flags say (shortname=mixed); long names in UTF-8,
//     surrogate pairs joined, lone surrogates dropped (utf8, Debian's
//     default). Lookups ignore the case of ASCII letters only and match a
//     file's short name as well as its long one (Debian's iocharset=ascii).
//   - FAT has no holes, links, devices or owners of its own: every byte of
//     a file is data.
//
// Inode numbers name a file's short entry by its directory's first
// cluster and its index there (inode.go); the root is 1.
//
// Hostile input. Everything is bounded where it is read: the boot sector
// is checked as Linux's fat_read_bpb does and its layout must lie inside
// the partition; every cluster of a chain must lie in the data area, a
// chain longer than the volume loops, a directory holds at most 65536
// entries. Where Linux would go on, this package stops with a
// *guestfs.FormatError naming the inode and the field:
//
//   - a file whose DIR_FileSize needs more clusters than its chain has
//     fails to open (Linux fails the read past the chain with EIO; a file
//     with no first cluster but a size Linux reads as zeros);
//   - a directory whose ".." entry does not name the directory it was
//     found in fails (Linux does not check): so a subdirectory that points
//     back at an ancestor, which would make an endless tree, is an error,
//     and no walk of the tree can loop;
//   - a name no Linux listing can hand out (empty, with a '/', "." or
//     "..") fails the listing of its directory, as getdents does
//     (EUCLEAN), after the entries before it.
//
// Deleted entries, and long-name slots that belong to no short entry or
// whose checksum does not match, are skipped, as Linux skips them: they
// are what DOS tools and crashes leave, not corruption. Chains that share
// clusters are read as they are, as Linux reads them.
//
// Memory: the FAT is read in 16 KiB blocks through a 4 MiB cache (a
// FAT32's is never copied whole), chains keep at most 2048 runs each in a
// cache of 512, parsed directories a cache of about 16 MiB.
package fat
