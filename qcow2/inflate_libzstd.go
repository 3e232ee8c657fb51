//go:build cgo

package qcow2

/*
#cgo LDFLAGS: -lzstd
#include <zstd.h>

// qcowfs_zstd_decode decodes the frame at the start of src into dst: one
// cgo call per cluster. It returns the decoded size, or a libzstd error
// code (which no cluster size equals).
static size_t qcowfs_zstd_decode(ZSTD_DCtx *d, void *dst, size_t dn, const void *src, size_t sn) {
	size_t n = ZSTD_findFrameCompressedSize(src, sn);
	if (ZSTD_isError(n)) {
		return n;
	}
	return ZSTD_decompressDCtx(d, dst, dn, src, n);
}
*/
import "C"

import (
	"errors"
	"runtime"
	"unsafe"
)

// zstd clusters with libzstd, through cgo, where a frame is the common
// case: one frame that declares its content size, exactly one cluster,
// and a window within the bound (zstdFastFrame). Measured on 64 KiB
// clusters qemu-img compressed from /usr (2 cores): libzstd 1.24-1.34
// GB/s, klauspost/compress/zstd 1.00-1.07 GB/s (its stream; its DecodeAll
// 0.68-0.84). Every other frame, and any frame libzstd refuses, is left
// to klauspost's stream decoder, which decides as qemu does. Build with
// CGO_ENABLED=0 for the pure-Go reader only (inflate_go.go).

// haveLibzstd tells which zstd decoder this build tries first.
const haveLibzstd = true

// zstdDecoder wraps one libzstd decompression context (not safe for
// concurrent use; pooled by decompressor). Its C memory is freed when it
// is collected.
type zstdDecoder struct {
	d *C.ZSTD_DCtx
}

func newZstdDecoder() *zstdDecoder {
	z := &zstdDecoder{d: C.ZSTD_createDCtx()}
	if z.d == nil {
		return nil
	}
	runtime.AddCleanup(z, func(d *C.ZSTD_DCtx) { C.ZSTD_freeDCtx(d) }, z.d)
	return z
}

var errLibzstd = errors.New("libzstd cannot decode this frame exactly")

// decode decodes the frame at the start of src into all of dst, which
// it must fill exactly; what follows the frame in src is ignored.
func (z *zstdDecoder) decode(dst, src []byte) error {
	if len(src) == 0 || len(dst) == 0 {
		return errLibzstd
	}
	got := C.qcowfs_zstd_decode(z.d, unsafe.Pointer(&dst[0]), C.size_t(len(dst)), unsafe.Pointer(&src[0]), C.size_t(len(src)))
	if uint64(got) != uint64(len(dst)) {
		return errLibzstd
	}
	return nil
}
