// Package test holds qcowfs's end-to-end tests: they build the qcowfs
// binary, mount qemu-made images through a real FUSE mount, and check what
// real tools (cmp, cp, losetup, mount) see against qemu-img's output.
// They live in sub-packages by subject:
//
//   - cli: the command line: mount and unmount, the daemon, signals,
//     status, the mount-helper convention (mount -t, fstab), flags and
//     options, errors, help; info, map and check against qemu-img.
//   - read: reading through a mount: bytes, holes and lseek, the tree of
//     files, snapshots, partitions, changed-blocks views of bitmaps,
//     loop-mounted guests, images changed between opens.
//   - lock: sharing images with qemu and other mounts by qemu's locks.
//   - write: writable mounts: writes, the writeback cache, overlays
//     (throwaway ones too), guest file systems written through loop devices, ENOSPC, torn
//     sectors, a daemon killed mid-write, persistent bitmaps kept true
//     and the incremental-backup recipe.
//   - hostile: hostile images and sources: fields at their limits, huge
//     tables, corrupt clusters, stuck disks, swapped folders, descriptor
//     and memory bounds.
//   - remote: images over HTTP(S) and S3 (nginx, versitygw, a fault
//     proxy), and local overlays over them (qemu reading them through
//     its curl driver), the base-version rule, throwaway overlays.
//
// They share test/harness (building the binary, mounts, daemons, the
// commands' runs), test/qemu (qemu-img and qemu-io, the oracle) and
// test/servers. test/bench is the benchmark, not a test.
//
// They need root, /dev/fuse and qemu-utils. Under CI=true a missing
// requirement fails the test; elsewhere it skips it.
package test
