// Package qcow2 reads QEMU qcow2 disk images.
//
// It owns everything about the on-disk format and nothing about how the
// image is served: there is no FUSE in this package. An opened [Image] is an
// [io.ReaderAt] over the guest-visible (virtual) disk, with [Image.Size],
// [Image.Extent] for block status, and [Image.Close].
//
// The format is specified in qemu's docs/interop/qcow2.rst; names in this
// package (L1, L2, refcount, cluster, subcluster, ...) follow it, and so do
// the field names of [Header]. qemu is the reference implementation: where
// the specification is silent, this package does what block/qcow2*.c does.
//
// Files, one concept each:
//
//   - header.go: the header and its extensions, validated field by field.
//   - l2.go: decoding L1 and L2 entries into cluster kinds.
//   - cache.go: the bounded table cache shared by every image of a mount.
//   - image.go: Open, the backing chain, ReadAt.
//   - extent.go: block status (what a guest range is and where it lives).
//   - compress.go: deflate and zstd compressed clusters.
//   - backing.go: resolving and opening backing files.
//   - info.go: the image summary printed by `qcowfs info`.
//   - crypt.go: describing encrypted images (AES, the LUKS header), which
//     are not read.
//   - probe.go: the build's inflater, lock probing without locks, locks on
//     raw files.
//
// Everything hangs off the opened Image; there is no package-level state.
// An Image is safe for concurrent use by many goroutines.
package qcow2
