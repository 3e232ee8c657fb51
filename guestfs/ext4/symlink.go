package ext4

import (
	"errors"
	"fmt"
	"io"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/qcowfs/qcowfs/guestfs"
)

// readLink reads a symbolic link's target as the kernel does
// (ext4_iget's choice between fast and slow symlinks, then readlink):
// from i_block for a fast symlink, else from the link's first block or
// inline data, up to s_blocksize-1 bytes and the first NUL.
func (fs *FS) readLink(in *inode) (string, error) {
	if in.fileType() != unix.S_IFLNK {
		return "", fmt.Errorf("%s: inode %d: not a symbolic link: %w", fs.typ, in.ino, syscall.EINVAL)
	}
	if in.flags&flagEncrypt != 0 {
		return "", &guestfs.UnsupportedError{Type: fs.typ, Msg: fmt.Sprintf("inode %d: an encrypted symbolic link (fscrypt)", in.ino)}
	}
	if in.size == 0 {
		return "", fs.formatError(in.ino, "i_size", 0, "an empty symbolic link")
	}
	if fs.fastSymlink(in) {
		n := int(in.size)
		if n >= iBlockLen || strings.IndexByte(string(in.block[:n+1]), 0) != n {
			return "", fs.formatError(in.ino, "i_size", in.size, "does not match the fast symlink's target in i_block")
		}
		return string(in.block[:n]), nil
	}
	n := min(in.size, uint64(fs.sb.BlockSize-1), maxSymlinkSize)
	b := make([]byte, n)
	f := &file{fs: fs, in: in}
	if _, err := f.ReadAt(b, 0); err != nil && !errors.Is(err, io.EOF) {
		return "", err
	}
	if i := strings.IndexByte(string(b), 0); i >= 0 {
		b = b[:i]
	}
	return string(b), nil
}

// fastSymlink says whether a symbolic link's target is in i_block
// (ext4_inode_is_fast_symlink): it has no blocks of its own but an
// extended attribute block, and no inline data.
func (fs *FS) fastSymlink(in *inode) bool {
	if in.flags&flagEAInode != 0 {
		return in.size < iBlockLen
	}
	if in.flags&flagInlineData != 0 {
		return false
	}
	var eaBlocks uint64
	if in.fileACL != 0 {
		eaBlocks = uint64(fs.sb.BlockSize) << (fs.sb.LogClusterSize - fs.sb.LogBlockSize) >> 9
	}
	return in.blocks == eaBlocks
}
