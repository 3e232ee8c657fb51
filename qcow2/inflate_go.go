//go:build !cgo

package qcow2

import "errors"

// Without cgo, raw deflate is decoded with compress/flate only.
const haveLibdeflate = false

type rawInflater struct{}

func newRawInflater() *rawInflater { return nil }

func (r *rawInflater) inflate(dst, src []byte) error { return errors.New("no libdeflate") }

// Without cgo, zstd is decoded with klauspost/compress/zstd only.
const haveLibzstd = false

type zstdDecoder struct{}

func newZstdDecoder() *zstdDecoder { return nil }

func (z *zstdDecoder) decode(dst, src []byte) error { return errors.New("no libzstd") }
