package fuseuring

import (
	"fmt"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The io_uring system call interface (include/uapi/linux/io_uring.h),
// the part a FUSE ring uses: a ring of 128-byte submission entries, one
// registered file (/dev/fuse), URING_CMD submissions and waiting for
// their completions. Raw system calls: no Go io_uring library kept up
// to date supports SQE128 and URING_CMD.

const (
	setupCQSize = 1 << 3  // IORING_SETUP_CQSIZE
	setupSQE128 = 1 << 10 // IORING_SETUP_SQE128

	featSingleMmap = 1 << 0 // IORING_FEAT_SINGLE_MMAP

	offSQRing = 0          // IORING_OFF_SQ_RING
	offSQEs   = 0x10000000 // IORING_OFF_SQES

	enterGetEvents = 1 << 0 // IORING_ENTER_GETEVENTS

	registerFiles = 2 // IORING_REGISTER_FILES

	opURingCmd    = 46     // IORING_OP_URING_CMD
	sqeFixedFile  = 1 << 0 // IOSQE_FIXED_FILE
	sqeSize       = 128    // with IORING_SETUP_SQE128
	cqeSize       = 16     // struct io_uring_cqe without IORING_SETUP_CQE32
	sqeCmdOffset  = 48     // struct io_uring_sqe's cmd[]: 80 bytes with SQE128
	sqeCmdOpField = 8      // cmd_op (u32), in the union with off
)

// params is struct io_uring_params.
type params struct {
	sqEntries, cqEntries, flags, sqThreadCPU, sqThreadIdle, features, wqFd uint32
	resv                                                                   [3]uint32
	sqOff                                                                  sqringOffsets
	cqOff                                                                  cqringOffsets
}

// sqringOffsets is struct io_sqring_offsets.
type sqringOffsets struct {
	head, tail, ringMask, ringEntries, flags, dropped, array, resv1 uint32
	userAddr                                                        uint64
}

// cqringOffsets is struct io_cqring_offsets.
type cqringOffsets struct {
	head, tail, ringMask, ringEntries, overflow, cqes, flags, resv1 uint32
	userAddr                                                        uint64
}

// cqe is struct io_uring_cqe.
type cqe struct {
	userData uint64
	res      int32
	flags    uint32
}

// A ring is one io_uring instance used by one thread: it alone writes
// submissions and reads completions, so the ring needs no lock.
type ring struct {
	fd         int
	rings, sqe []byte // the mmapped SQ and CQ rings; the SQE array

	sqHead, sqTail, sqMask *uint32
	sqArray                unsafe.Pointer
	cqHead, cqTail, cqMask *uint32
	cqes                   unsafe.Pointer
	pending                uint32 // submissions written and not yet taken by the kernel
}

// newRing sets up a ring of sqEntries 128-byte submissions.
func newRing(sqEntries uint32) (*ring, error) {
	p := params{flags: setupSQE128 | setupCQSize, cqEntries: 2 * sqEntries}
	fd, _, errno := unix.Syscall(unix.SYS_IO_URING_SETUP, uintptr(sqEntries), uintptr(unsafe.Pointer(&p)), 0)
	if errno != 0 {
		return nil, fmt.Errorf("io_uring_setup with 128-byte entries: %w", errno)
	}
	r := &ring{fd: int(fd)}
	if p.features&featSingleMmap == 0 {
		r.close()
		return nil, fmt.Errorf("io_uring without IORING_FEAT_SINGLE_MMAP (kernel older than 5.4)")
	}
	size := max(p.sqOff.array+p.sqEntries*4, p.cqOff.cqes+p.cqEntries*cqeSize)
	var err error
	if r.rings, err = unix.Mmap(r.fd, offSQRing, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE); err != nil {
		r.close()
		return nil, fmt.Errorf("mapping the io_uring rings: %w", err)
	}
	if r.sqe, err = unix.Mmap(r.fd, offSQEs, int(p.sqEntries*sqeSize), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE); err != nil {
		r.close()
		return nil, fmt.Errorf("mapping the io_uring submission entries: %w", err)
	}
	at := func(off uint32) *uint32 { return (*uint32)(unsafe.Pointer(&r.rings[off])) }
	r.sqHead, r.sqTail, r.sqMask = at(p.sqOff.head), at(p.sqOff.tail), at(p.sqOff.ringMask)
	r.sqArray = unsafe.Pointer(&r.rings[p.sqOff.array])
	r.cqHead, r.cqTail, r.cqMask = at(p.cqOff.head), at(p.cqOff.tail), at(p.cqOff.ringMask)
	r.cqes = unsafe.Pointer(&r.rings[p.cqOff.cqes])
	return r, nil
}

// registerFile makes fd the ring's fixed file 0; the ring holds its own
// reference to the file from then on.
func (r *ring) registerFile(fd int) error {
	fds := [1]int32{int32(fd)}
	_, _, errno := unix.Syscall6(unix.SYS_IO_URING_REGISTER, uintptr(r.fd), registerFiles, uintptr(unsafe.Pointer(&fds[0])), 1, 0, 0)
	if errno != 0 {
		return fmt.Errorf("io_uring_register of /dev/fuse: %w", errno)
	}
	return nil
}

// nextSQE returns the next free submission entry, zeroed, or nil if the
// submission ring is full.
func (r *ring) nextSQE() []byte {
	tail := *r.sqTail
	if tail-atomic.LoadUint32(r.sqHead) > *r.sqMask {
		return nil
	}
	i := tail & *r.sqMask
	s := r.sqe[i*sqeSize : (i+1)*sqeSize]
	clear(s)
	*(*uint32)(unsafe.Add(r.sqArray, 4*i)) = i
	atomic.StoreUint32(r.sqTail, tail+1)
	r.pending++
	return s
}

// enter submits what is pending and, with wait, waits until a completion
// is there. It returns the kernel's error for the call itself (EINTR is
// retried); errors of the submissions come as completions.
func (r *ring) enter(wait bool) error {
	for {
		var flags, min uintptr
		if wait {
			flags, min = enterGetEvents, 1
		}
		_, _, errno := unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(r.pending), min, flags, 0, 0)
		// Whatever the result, the kernel's head says what it took.
		r.pending = *r.sqTail - atomic.LoadUint32(r.sqHead)
		switch errno {
		case 0:
			return nil
		case syscall.EINTR:
			if !wait || r.ready() {
				return nil
			}
			continue
		default:
			return fmt.Errorf("io_uring_enter: %w", errno)
		}
	}
}

// ready reports whether a completion is waiting.
func (r *ring) ready() bool {
	return atomic.LoadUint32(r.cqTail) != *r.cqHead
}

// peek returns the oldest completion; ok is false if there is none.
func (r *ring) peek() (c cqe, ok bool) {
	head := *r.cqHead
	if atomic.LoadUint32(r.cqTail) == head {
		return c, false
	}
	return *(*cqe)(unsafe.Add(r.cqes, cqeSize*(head&*r.cqMask))), true
}

// advance consumes the oldest completion.
func (r *ring) advance() {
	atomic.StoreUint32(r.cqHead, *r.cqHead+1)
}

func (r *ring) close() {
	if r.sqe != nil {
		unix.Munmap(r.sqe)
	}
	if r.rings != nil {
		unix.Munmap(r.rings)
	}
	unix.Close(r.fd)
}
