package qcow2

import (
	"io"
	"sync/atomic"
	"testing"

	"github.com/qcowfs/qcowfs/luks"
)

// CountUnlocks counts the LUKS unlocks (PBKDF2 over the key slots) of
// every image opened until the test ends. Only for tests that do not run
// in parallel: it replaces a package variable.
func CountUnlocks(t testing.TB) *atomic.Int64 {
	n := new(atomic.Int64)
	prev := unlockLUKS
	unlockLUKS = func(h *luks.Header, r io.ReaderAt, pass []byte) (*luks.Cipher, error) {
		n.Add(1)
		return prev(h, r, pass)
	}
	t.Cleanup(func() { unlockLUKS = prev })
	return n
}
