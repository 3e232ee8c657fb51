package fuseuring

// FUSE over io_uring (include/uapi/linux/fuse.h, protocol 7.42; the
// kernel's fs/fuse/dev_uring.c). Each ring entry is two buffers given to
// the kernel at FUSE_IO_URING_CMD_REGISTER: a header (struct
// fuse_uring_req_header) and a payload buffer at least as large as the
// connection's largest request or reply.
const (
	// struct fuse_uring_req_header: in_out holds the fuse_in_header of a
	// request and the fuse_out_header of its reply; op_in the request's
	// per-opcode struct (its in_args[0]); ring_ent_in_out, struct
	// fuse_uring_ent_in_out, the commit ID and the payload's length.
	hdrInOut      = 0
	hdrOpIn       = 128
	hdrOpInSize   = 128 // FUSE_URING_OP_IN_OUT_SZ
	hdrCommitID   = 256 + 8
	hdrPayloadLen = 256 + 16
	hdrSize       = 256 + 32

	inHeaderSize  = 40 // struct fuse_in_header
	outHeaderSize = 16 // struct fuse_out_header

	// enum fuse_uring_cmd, the cmd_op of a URING_CMD on /dev/fuse.
	cmdRegister       = 1 // FUSE_IO_URING_CMD_REGISTER
	cmdCommitAndFetch = 2 // FUSE_IO_URING_CMD_COMMIT_AND_FETCH

	// struct fuse_uring_cmd_req, in the SQE's 80-byte command area.
	cmdReqCommitID = 8
	cmdReqQID      = 16

	minPayload = 8192 // FUSE_MIN_READ_BUFFER: the kernel's smallest payload buffer

	opWrite = 16 // FUSE_WRITE
)
