// Package partition reads the partition table of a disk: GPT, or MBR with
// its extended and logical partitions. The disk is an [io.ReaderAt] and a
// size; [Read] returns the partitions as byte ranges of it, numbered the way
// the Linux kernel numbers them (so partition 5 here is /dev/sda5 there), and
// refuses, with a warning, any range that lies outside the disk or overlaps
// another. It owns nothing of qcow2 or FUSE and imports nothing of qcowfs.
//
// Everything read from the disk is untrusted: every field is range-checked
// where it is read, allocations are bounded (at most [MaxEntryArray] bytes of
// GPT entries, at most [MaxEBRs] extended boot records), and a malformed
// table is an error wrapping [ErrCorrupt], never a panic. A disk that holds
// no partition table at all (zeros, or a file system written to the whole
// disk) is an error wrapping [ErrNoTable].
//
// # GPT
//
// The GUID Partition Table is defined in chapter 5 of the UEFI
// Specification (version 2.10, "GUID Partition Table (GPT) Disk Layout").
// A GPT disk starts with a protective MBR (§5.2.3): an MBR whose partition
// record of OSType 0xEE covers the disk, so that MBR-only software sees one
// unknown partition. [Read] treats a disk as GPT exactly when its MBR holds
// such a record, as the kernel, sfdisk and blkid do; a GPT header without a
// protective MBR is ignored.
//
// The GPT header (§5.3.2, table "GPT Header") sits at LBA 1 and a backup
// copy at the last LBA of the disk. Its fields, all little-endian:
//
//	offset size field
//	     0    8 Signature                 "EFI PART"
//	     8    4 Revision                  0x00010000 (1.0)
//	    12    4 HeaderSize                92 <= HeaderSize <= block size
//	    16    4 HeaderCRC32               CRC32 of HeaderSize bytes, this field zeroed
//	    20    4 Reserved
//	    24    8 MyLBA                     the LBA holding this header
//	    32    8 AlternateLBA              the LBA of the other header
//	    40    8 FirstUsableLBA            first LBA a partition may use
//	    48    8 LastUsableLBA             last LBA a partition may use
//	    56   16 DiskGUID
//	    72    8 PartitionEntryLBA         first LBA of the partition entry array
//	    80    4 NumberOfPartitionEntries
//	    84    4 SizeOfPartitionEntry      128 x 2^n
//	    88    4 PartitionEntryArrayCRC32  CRC32 of the whole entry array
//
// Both CRCs are the CRC-32 of ISO 3309 / IEEE 802.3 (polynomial 0x04C11DB7,
// reflected, all ones in and out), which is [hash/crc32.IEEE]. A header is
// valid when its signature, major revision, size, header CRC and MyLBA check
// (the tests §5.3.2 lists), its LBAs fall inside the disk, and the CRC of
// its entry array checks. [Read] accepts any SizeOfPartitionEntry that is a
// multiple of 8 and at least 128 (the kernel wants exactly 128), and reads
// the first 128 bytes of each entry.
//
// Each entry (§5.3.3, table "GPT Partition Entry") holds a
// PartitionTypeGUID (all zeros: an unused entry), a UniquePartitionGUID,
// StartingLBA and EndingLBA (inclusive), Attributes and a 36-character
// UTF-16LE PartitionName. A partition must lie within FirstUsableLBA and
// LastUsableLBA. GUIDs are stored with their first three fields
// little-endian (UEFI Appendix A, "GUID and Time Formats"); [Read] returns
// them in the canonical text form of RFC 4122, lower case, as blkid prints
// them.
//
// When the primary header or its array is invalid, the specification says
// to look for the backup header at the last LBA, and that is what [Read]
// does, adding a warning; sfdisk, gdisk and parted do the same. The Linux
// kernel does not: unless booted with the "gpt" parameter it reads the backup
// only when the primary is valid, so a disk with a damaged primary GPT shows
// no partitions to losetup -P, while [Read] returns the backup's.
//
// The kernel names GPT partitions by entry index: entry i is partition i+1,
// so an unused entry between used ones leaves a gap in the numbering. It
// only looks at the first 255 entries (DISK_MAX_PARTS), and so does [Read].
//
// # MBR
//
// The classic MBR (UEFI §5.2.1, table "Legacy MBR") is LBA 0: 446 bytes of
// boot code (with a 4-byte disk signature at offset 440), four 16-byte
// partition records at offset 446 and the signature 0x55 0xAA at offset 510.
// A partition record ("Legacy MBR Partition Record") is:
//
//	offset size field
//	     0    1 BootIndicator   0x80 bootable, 0x00 not; anything else: not an MBR
//	     1    3 StartingCHS     ignored: LBAs are used
//	     4    1 OSType          the partition type byte (0x83 Linux, ...)
//	     5    3 EndingCHS       ignored
//	     8    4 StartingLBA     in logical blocks
//	    12    4 SizeInLBA       0: unused record
//
// A FAT or NTFS boot sector also ends in 0x55 0xAA, so, like the kernel,
// [Read] takes a boot indicator other than 0x00 or 0x80 to mean "not an
// MBR". And it takes an MBR with no used record at all for no partition
// table: that is what a freshly made FAT file system looks like (mkfs.vfat
// leaves zeros there), which the kernel and sfdisk list as an empty table
// and blkid tells apart by probing for a FAT boot sector. With nothing to
// return either way, [ErrNoTable] is the more useful answer.
//
// A record of type 0x05, 0x0F or 0x85 is an extended partition: a container
// whose first sector is an extended boot record (EBR) laid out like an MBR.
// An EBR's records describe one logical partition, with StartingLBA relative
// to the EBR itself, and a link to the next EBR, of an extended type, with
// StartingLBA relative to the start of the extended partition; a chain ends
// with an EBR that has no link. No standard defines EBRs; [Read] follows the
// Linux kernel (block/partitions/msdos.c, parse_extended): data records first,
// then the first link, the third and fourth records only when they lie
// inside the extended partition, logical partitions numbered from 5 in chain
// order. It stops at a loop, after [MaxEBRs] records, or at partition 255.
//
// Primary partitions keep their record's slot number, 1 to 4, whatever the
// gaps. An extended partition is returned too, with [Partition.Extended]
// set and its full size, as sfdisk lists it; it is a container, not a
// volume (the kernel's device for it covers only its first 1 KiB, or its
// first block if larger), and is exempt from the overlap check with the
// logical partitions it holds.
package partition
