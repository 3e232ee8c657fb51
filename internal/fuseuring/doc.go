// Package fuseuring serves a go-fuse mount's requests over FUSE over
// io_uring (Linux 6.14 and later, CONFIG_FUSE_IO_URING, switched on by
// root through /sys/module/fuse/parameters/enable_uring): instead of a
// read of /dev/fuse and a write of the reply per request, a ring entry
// gets its request from the kernel as an io_uring completion, and the
// reply goes back in the same io_uring_enter that waits for the next.
//
// It owns the rings and their threads, nothing else: requests go to the
// mounted go-fuse Server's HandleRequest (third_party/go-fuse's patch),
// which serves them with the same file system, the same state from INIT
// and the same in-flight table as the requests go-fuse reads from
// /dev/fuse. INIT, FORGET, INTERRUPT and the notifications stay on
// /dev/fuse: the kernel sends only other requests to the rings.
//
// The order a mount must keep (the kernel's fs/fuse/dev_uring.c): the
// rings are set up before the mount (New), the mount's INIT accepts
// FUSE_OVER_IO_URING (fuse.CAP_OVER_IO_URING), and right after INIT every
// CPU's queue gets its entries (Start); until then the kernel holds
// every request back, and a refused registration sends it back to
// /dev/fuse for good.
package fuseuring
