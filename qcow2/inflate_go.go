//go:build !cgo

package qcow2

import "errors"

// Without cgo, raw deflate is decoded with compress/flate only.
const haveLibdeflate = false

type rawInflater struct{}

func newRawInflater() *rawInflater { return nil }

func (r *rawInflater) inflate(dst, src []byte) error { return errors.New("no libdeflate") }
