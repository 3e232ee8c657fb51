// Package qcow2 reads and writes QEMU qcow2 disk images.
//
// It owns everything about the on-disk format and nothing about how the
// image is served: there is no FUSE in this package. An opened [Image] is an
// [io.ReaderAt] over the guest-visible (virtual) disk, with [Image.Size],
// [Image.Extent] for block status, [Image.NextData] and [Image.NextHole]
// for lseek, and [Image.Close]. [Open] opens a local file; [NewImage] opens
// any [HostFile] (a remote object, a buffer), with backing and data files
// opened through an injected [Opener]. Opened with [Options].Writable, it
// also takes [Image.WriteAt], [Image.WriteZeroes], [Image.Discard],
// [Image.Resize] and [Image.Flush].
//
// The format is specified in qemu's docs/interop/qcow2.rst; names in this
// package (L1, L2, refcount, cluster, subcluster, ...) follow it, and so do
// the field names of [Header]. qemu is the reference implementation: where
// the specification is silent, this package does what block/qcow2*.c does.
//
// Files, one concept each:
//
//   - doc.go, errors.go: this overview; every sentinel error and error type.
//   - hostfile.go: HostFile (the files an image is made of) and metaFile,
//     the one type through which metadata is read, tables decoded once.
//   - header.go: the header, its field table, validated field by field;
//     the format probe (Probe), as qemu decides a file is qcow2.
//   - extensions.go: header extensions and the backing file name.
//   - entries.go: L1 and L2 entry words and the rules that classify them.
//   - mapping.go: the read side of the cluster mapping, guest offset to
//     host offset through the L1 table and cached L2 tables.
//   - clockring.go: the CLOCK (second chance) eviction ring.
//   - clockcache.go: the sharded, lock-free-on-hit cache skeleton.
//   - cache.go: the table cache shared by every image of a mount.
//   - clustercache.go: the decompressed-cluster cache.
//   - image.go: Options, Open and NewImage, the Image, ReadAt.
//   - pin.go: the pins a read (or write) holds on the host clusters it
//     mapped, and when a freed cluster may be reused (Image.Pin,
//     Image.PinRange).
//   - layer.go: one file of the chain: the layer, its L1 table, host reads.
//   - backing.go: building the backing chain (formats, depth, loops).
//   - chainindex.go: which layer of a deep chain decides each granule,
//     so that a read below the top asks one layer.
//   - opener.go: the default opener of local backing and data files, with
//     name resolution and confinement.
//   - extent.go: block status (what a guest range is and where it lives).
//   - holes.go: the lseek hole index (NextData, NextHole, DataBytes),
//     its bounded, interruptible walks.
//   - stats.go: counters and allocated bytes.
//   - compress.go, inflate_go.go, inflate_libdeflate.go,
//     inflate_libzstd.go: deflate and zstd compressed clusters, and a
//     layer's state for reading them.
//   - refcount.go: refcounts: their layout in a refcount block
//     (refFormat), reading them.
//   - prealloc.go: metadata preallocation detection, by refcount block.
//   - metadata.go: the metadata map, for overlap checks.
//   - hostranges.go: the host bytes a whole read of the disk needs
//     (HostRanges), for fetching a remote image ahead of its readers.
//   - snapshot.go: internal snapshots.
//   - bitmap.go: persistent bitmaps: the directory and tables, where they
//     lie, what qemu-img info lists.
//   - bitmapview.go: a bitmap's dirty ranges (BitmapView), live from the
//     writer or read from the file.
//   - check.go: the image check, qemu-img check without repairs.
//   - check_counts.go: the check's reference counts, paged where they fall.
//   - budget.go: the memory budget for structures an image file sizes.
//   - lock.go: qemu's OFD image locks, their probing without locks, locks
//     on raw files.
//   - info.go, map.go: what `qcowfs info` and `qcowfs map` print; info.go
//     also describes an encrypted image without its key
//     (DescribeEncrypted), from the header and the LUKS header as an open
//     reads them.
//   - encrypt.go: encrypted images read and written: unlocking a layer's
//     LUKS header with Options.Passphrase, decryption in reads, encryption
//     at the writer's data door (read-modify-write of partial sectors).
//   - keycache.go: the master keys a mount unlocked (KeyCache), so that an
//     image opened again costs no PBKDF2.
//   - create.go: new images (Create; Prepare and Publish, its two halves),
//     laid out as qemu-img create lays them out.
//
// The write path (only the top image of a chain is written):
//
//   - writer.go: opening an image for writing, the writer and its parts
//     (each a type with its own methods, below), why an image opens
//     read-only.
//   - write.go: WriteAt and Resize, in runs of guest clusters, and the
//     guest ranges they hold (guestHolds).
//   - zero.go: Discard and WriteZeroes.
//   - writemap.go: the write side of the cluster mapping: planning what a
//     guest range needs, owning L2 tables, linking new clusters.
//   - cow.go: copy-on-write of the parts of a cluster a write leaves; the
//     pooled buffers writes are assembled in.
//   - alloc.go: the allocator (imago's Allocator): free clusters,
//     refcounts, refcount blocks, new tables, a larger refcount table
//     planned; what it is handed (allocEnv).
//   - reftable.go: the refcount table's growth, step by step.
//   - dirty.go: the dirty set, tables changed and not yet written back,
//     walked by the flush in its order.
//   - flush.go: the ordered write-back.
//   - freeing.go: freed references and clusters, their quarantine until
//     no pin (pin.go) can see them.
//   - hostwrite.go: the host door (hostDoor): every host write, sync,
//     punch and growth of the files, checked against the metadata map;
//     the header's writes; the files' sizes; the failed and corrupt
//     states.
//   - sectorlock.go: whole sectors for reads that race in-place writes.
//   - behind.go, direct.go: large data writes left in flight, with
//     O_DIRECT (made by the host door).
//   - bitmapwrite.go: persistent bitmaps kept true by writes (in_use,
//     bits, their store in the flush order, growth).
//
// Hostile input: every offset and length read from a file is checked
// before it is added to anything; every structure is within qemu's limits
// (block/qcow2.h, qcow2-bitmap.c) and charged to a memory budget
// (Options.Budget) before it is allocated; every walk over tables is
// bounded in work, cheap when tables repeat, and stops with its context
// (the methods that take one); an image whose metadata cannot be mapped
// is refused rather than read unchecked.
//
// Everything hangs off the opened Image; there is no package-level state.
// An Image is safe for concurrent use by many goroutines.
package qcow2
