package partition

// Names of a few well-known partition types, spelled as fdisk and sfdisk
// spell them (sfdisk --list-types), so that a caller's log line reads like
// their output. The test compares each with sfdisk's list.

// gptTypeNames maps a PartitionTypeGUID, in the lower-case canonical form
// Partition.Type holds, to its name. Definitions: UEFI §5.3.3 (EFI System,
// MBR partition scheme), and the Discoverable Partitions Specification of
// the UAPI group for the Linux ones.
var gptTypeNames = map[string]string{
	"c12a7328-f81f-11d2-ba4b-00a0c93ec93b": "EFI System",
	"024dee41-33e7-11d3-9d69-0008c781f39f": "MBR partition scheme",
	"21686148-6449-6e6f-744e-656564454649": "BIOS boot",
	"0fc63daf-8483-4772-8e79-3d69d8477de4": "Linux filesystem",
	"0657fd6d-a4ab-43c4-84e5-0933c84b4f4f": "Linux swap",
	"e6d6d379-f507-44c2-a23c-238f2a3df928": "Linux LVM",
	"a19d880f-05fc-4d3b-a006-743f0f84911e": "Linux RAID",
	"933ac7e1-2eb4-4f13-b844-0e14e2aef915": "Linux home",
	"3b8f8425-20e0-4f3b-907f-1a25a76f98e8": "Linux server data",
	"4f68bce3-e8cd-4db1-96e7-fbcaf984b709": "Linux root (x86-64)",
	"b921b045-1df0-41c3-af44-4c6f280d3fae": "Linux root (ARM-64)",
	"8484680c-9521-48c6-9c11-b0720656f69e": "Linux /usr (x86-64)",
	"bc13c2ff-59e6-4262-a352-b275fd6f7172": "Linux extended boot",
	"8da63339-0007-60c0-c436-083ac8230908": "Linux reserved",
	"ebd0a0a2-b9e5-4433-87c0-68b6b72699c7": "Microsoft basic data",
	"e3c9e316-0b5c-4db8-817d-f92df00215ae": "Microsoft reserved",
	"de94bba4-06d1-4d40-a16a-bfd50179d6ac": "Windows recovery environment",
}

// mbrTypeNames maps an MBR OSType byte to its name.
var mbrTypeNames = map[uint8]string{
	0x01:              "FAT12",
	0x04:              "FAT16 <32M",
	typeExtended:      "Extended",
	0x06:              "FAT16",
	0x07:              "HPFS/NTFS/exFAT",
	0x0b:              "W95 FAT32",
	0x0c:              "W95 FAT32 (LBA)",
	0x0e:              "W95 FAT16 (LBA)",
	typeExtendedLBA:   "W95 Ext'd (LBA)",
	0x82:              "Linux swap / Solaris",
	0x83:              "Linux",
	typeLinuxExtended: "Linux extended",
	0x8e:              "Linux LVM",
	0xa5:              "FreeBSD",
	0xa6:              "OpenBSD",
	0xa9:              "NetBSD",
	typeGPTProtective: "GPT",
	0xef:              "EFI (FAT-12/16/32)",
	0xfd:              "Linux raid autodetect",
}
