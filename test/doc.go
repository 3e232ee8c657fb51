// Package test holds qcowfs's end-to-end tests: they build the qcowfs
// binary, mount qemu-made images through a real FUSE mount, and check what
// real tools (cmp, cp, losetup, mount) see against qemu-img's output.
//
// They need root, /dev/fuse and qemu-utils. Under CI=true a missing
// requirement fails the test; elsewhere it skips it.
package test
