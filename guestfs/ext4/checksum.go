package ext4

import "hash/crc32"

// The checksums of ext4's metadata_csum feature are CRC-32C (Castagnoli)
// the way the kernel computes them (ext4_chksum, crc32c_le): a running
// value with no inversion on the way in or out, seeded by the caller.
// hash/crc32 inverts both ways, so crc32c undoes that.

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// crc32c continues the kernel's raw CRC-32C crc over p.
func crc32c(crc uint32, p []byte) uint32 {
	return ^crc32.Update(^crc, castagnoli, p)
}

// crc32cLE32 continues crc over v as four little-endian bytes, as the
// kernel feeds inode and group numbers.
func crc32cLE32(crc uint32, v uint32) uint32 {
	return crc32c(crc, []byte{byte(v), byte(v >> 8), byte(v >> 16), byte(v >> 24)})
}

// crc16 is the kernel's lib/crc16.c (CRC-16 with the reflected polynomial
// 0xA001, no inversion), which the gdt_csum feature (uninit_bg) uses for
// group descriptors when metadata_csum is off.
func crc16(crc uint16, p []byte) uint16 {
	for _, b := range p {
		crc ^= uint16(b)
		for range 8 {
			if crc&1 != 0 {
				crc = crc>>1 ^ 0xA001
			} else {
				crc >>= 1
			}
		}
	}
	return crc
}

// crc32BE is the kernel's crc32_be (CRC-32, polynomial 0x04C11DB7, not
// reflected, no inversion), which jbd2's v1 transaction checksums
// (JBD2_FEATURE_COMPAT_CHECKSUM) use.
func crc32BE(crc uint32, p []byte) uint32 {
	for _, b := range p {
		crc ^= uint32(b) << 24
		for range 8 {
			if crc&0x80000000 != 0 {
				crc = crc<<1 ^ 0x04C11DB7
			} else {
				crc <<= 1
			}
		}
	}
	return crc
}
