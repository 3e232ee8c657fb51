package fs

// CopyReads has image reads answered through the request's buffer, not
// spliced: over a FUSE-over-io_uring ring the reply must be in the ring
// entry's buffer, where a read puts it with one copy and a splice would
// need a pipe read on top. Call it before the mount serves a request.
func (r *Root) CopyReads() {
	r.m.cfg.ReadPath = ReadCopy
}
