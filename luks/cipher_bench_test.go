package luks

import (
	"testing"
	"time"
)

// BenchmarkDecrypt measures sector decryption of 64 KiB (a cluster) for
// the common specifications.
func BenchmarkDecrypt(b *testing.B) {
	for _, s := range []Spec{
		{CipherAlg: "aes-256", CipherMode: "xts", IvgenAlg: "plain64", HashAlg: "sha256"},
		{CipherAlg: "aes-256", CipherMode: "cbc", IvgenAlg: "essiv", IvgenHashAlg: "sha256", HashAlg: "sha256"},
	} {
		b.Run(s.CipherMode, func(b *testing.B) {
			_, _, c, err := Create(Params{Spec: s, Iterations: 1000, MKDigestIter: 1000, IterTime: time.Millisecond}, []byte("x"))
			if err != nil {
				b.Fatal(err)
			}
			buf := make([]byte, 64<<10)
			b.SetBytes(int64(len(buf)))
			for i := 0; b.Loop(); i++ {
				c.Decrypt(buf, uint64(i)*128)
			}
		})
	}
}
