package fuseuring

import (
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A lane is one ring entry of a queue with a ring and a thread of its
// own: the thread waits for the entry's request, serves it, and commits
// the reply and fetches the next request in one io_uring_enter. One entry
// per ring, not many: a lane whose handler blocks (a remote read, a write
// that waits on the kernel) holds back its own entry only, and the kernel
// hands the queue's next request to another lane's entry (queue.go adds
// lanes while all are busy). The io_uring requests are the thread's: the
// kernel delivers a request into the entry's buffers from the task that
// submitted the entry's last command, so the goroutine stays locked to
// its thread.
type lane struct {
	q    *queue
	ring *ring
	mem  []byte // hdr and payload, mapped
	hdr  []byte // struct fuse_uring_req_header
	// payload is the request's payload and the reply's data; scratch a
	// copy of a request's payload that the reply would overwrite.
	payload, scratch []byte
	iov              [2]unix.Iovec // header and payload, for REGISTER
	commitID         uint64
}

// newLane makes a lane for queue q: its ring and its buffers.
func newLane(q *queue) (*lane, error) {
	r, err := newRing(1)
	if err != nil {
		return nil, err
	}
	page := unix.Getpagesize()
	size := q.t.payloadSize
	mem, err := unix.Mmap(-1, 0, page+size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		r.close()
		return nil, fmt.Errorf("mapping the buffers of a ring entry: %w", err)
	}
	l := &lane{q: q, ring: r, mem: mem, hdr: mem[:hdrSize], payload: mem[page:]}
	l.iov[0].Base, l.iov[0].Len = &l.hdr[0], uint64(len(l.hdr))
	l.iov[1].Base, l.iov[1].Len = &l.payload[0], uint64(len(l.payload))
	return l, nil
}

func (l *lane) close() {
	l.ring.close()
	unix.Munmap(l.mem)
}

// submit writes a command for the lane's entry: REGISTER with the
// buffers, or COMMIT_AND_FETCH of the reply in them.
func (l *lane) submit(op uint32) error {
	s := l.ring.nextSQE()
	if s == nil {
		return errors.New("io_uring submission ring full")
	}
	s[0] = opURingCmd
	s[1] = sqeFixedFile // fd 0 of the ring's files: /dev/fuse
	binary.NativeEndian.PutUint32(s[sqeCmdOpField:], op)
	cmd := s[sqeCmdOffset:]
	binary.NativeEndian.PutUint16(cmd[cmdReqQID:], uint16(l.q.qid))
	if op == cmdRegister {
		binary.NativeEndian.PutUint64(s[16:], uint64(uintptr(unsafe.Pointer(&l.iov[0])))) // addr
		binary.NativeEndian.PutUint32(s[24:], uint32(len(l.iov)))                         // len
	} else {
		binary.NativeEndian.PutUint64(cmd[cmdReqCommitID:], l.commitID)
	}
	return nil
}

// register gives the kernel the lane's entry, on the calling thread,
// which must be the lane's. The kernel answers REGISTER only when the
// entry gets its first request, or at once with an error: any error is
// in the completion queue when the submitting call returns.
func (l *lane) register() error {
	if err := l.submit(cmdRegister); err != nil {
		return err
	}
	if err := l.ring.enter(false); err != nil {
		return err
	}
	if c, ok := l.ring.peek(); ok && c.res < 0 {
		return fmt.Errorf("FUSE_IO_URING_CMD_REGISTER on queue %d: %w", l.q.qid, syscall.Errno(-c.res))
	}
	return nil
}

// serve is the lane's loop, on its own thread, until the connection
// ends. started gets the result of the registration.
func (l *lane) serve(started func(error)) {
	runtime.LockOSThread()
	// The thread dies with the goroutine, and with it the
	// io_uring requests it submitted: all done by then.
	defer l.close()
	setAffinity(l.q.qid)
	err := l.register()
	started(err)
	if err != nil {
		return
	}
	l.q.idle.Add(1)
	for {
		if err := l.ring.enter(true); err != nil {
			l.q.t.logf("queue %d: %v", l.q.qid, err)
			return
		}
		c, ok := l.ring.peek()
		if !ok {
			continue
		}
		l.ring.advance()
		if c.res != 0 {
			// ENOTCONN: the connection is gone (unmounted, aborted).
			if c.res != -int32(syscall.ENOTCONN) {
				l.q.t.logf("queue %d: ring entry: %v", l.q.qid, syscall.Errno(-c.res))
			}
			return
		}
		l.q.taken()
		l.handle()
		if err := l.submit(cmdCommitAndFetch); err != nil {
			l.q.t.logf("queue %d: %v", l.q.qid, err)
			return
		}
		l.q.idle.Add(1)
	}
}

// handle serves the request in the lane's buffers and puts the reply in
// them. go-fuse's HandleRequest reads and writes the classic /dev/fuse
// layout as a stream of bytes; the ring has the headers apart from the
// rest: a request is the in header, the opcode's struct (op_in) and the
// payload; a reply is the out header (in_out) and then everything else
// in the payload buffer.
func (l *lane) handle() {
	h := l.hdr
	l.commitID = binary.NativeEndian.Uint64(h[hdrCommitID:])
	total := int(binary.NativeEndian.Uint32(h[hdrInOut:]))
	opcode := binary.NativeEndian.Uint32(h[hdrInOut+4:])
	unique := binary.NativeEndian.Uint64(h[hdrInOut+8:])
	plen := int(binary.NativeEndian.Uint32(h[hdrPayloadLen:]))
	oplen := total - inHeaderSize - plen
	if plen > len(l.payload) || oplen < 0 || oplen > hdrOpInSize {
		l.q.t.logf("queue %d: request %d (opcode %d): length %d, payload %d: not a request of the ring's layout", l.q.qid, unique, opcode, total, plen)
		l.reply(unique, -int32(syscall.EIO), 0)
		return
	}
	payload := l.payload[:plen]
	if plen > 0 && opcode != opWrite {
		// A name or an xattr value, which the reply (written into
		// the same buffer) could overwrite before the handler is done
		// reading it. A WRITE's data is read before its reply.
		l.scratch = append(l.scratch[:0], payload...)
		payload = l.scratch
	}
	in := [3][]byte{h[hdrInOut : hdrInOut+inHeaderSize], h[hdrOpIn : hdrOpIn+oplen], payload}
	out := [2][]byte{h[hdrInOut : hdrInOut+outHeaderSize], l.payload}
	n, st := l.q.t.server.HandleRequest(in[:], out[:])
	switch {
	case n >= outHeaderSize:
		binary.NativeEndian.PutUint32(h[hdrPayloadLen:], uint32(n-outHeaderSize))
	case !st.Ok():
		l.reply(unique, -int32(st), 0)
	default:
		// No reply (a NOTIFY_REPLY): the kernel still waits for the
		// entry's commit.
		l.reply(unique, 0, 0)
	}
}

// reply writes a reply of just an out header.
func (l *lane) reply(unique uint64, errno int32, plen int) {
	h := l.hdr
	binary.NativeEndian.PutUint32(h[hdrInOut:], uint32(outHeaderSize+plen))
	binary.NativeEndian.PutUint32(h[hdrInOut+4:], uint32(errno))
	binary.NativeEndian.PutUint64(h[hdrInOut+8:], unique)
	binary.NativeEndian.PutUint32(h[hdrPayloadLen:], uint32(plen))
}

// setAffinity runs the calling thread on CPU cpu only: the kernel queues
// a request on the queue of the CPU its caller runs on, so the lane
// answers where the caller waits.
func setAffinity(cpu int) {
	var set unix.CPUSet
	set.Set(cpu)
	unix.SchedSetaffinity(0, &set)
}
