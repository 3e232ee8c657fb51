package qcow2

import (
	"crypto/sha256"
	"sync"
)

// KeyCache remembers the master keys of LUKS headers unlocked before, so
// that an image opened again (a mount opens each image to list it, and
// again for each user) is not unlocked with PBKDF2 every time: with
// qemu's default iter-time that costs seconds of CPU, by design. An entry
// is found by a hash of the whole header area (key slots included) and of
// the passphrase given: the same header under the same passphrase has the
// same master key, so nothing is checked again, and a changed passphrase
// or header unlocks afresh. The keys stay in memory until Close, as
// qemu's own daemons keep them for as long as they run. Share one
// KeyCache between the images of a mount (Options.KeyCache); it is safe
// for concurrent use.
type KeyCache struct {
	mu   sync.Mutex
	keys map[[sha256.Size]byte][]byte // guarded by mu
}

// maxCachedKeys bounds a KeyCache: past it, keys are not remembered.
const maxCachedKeys = 4096

// NewKeyCache returns an empty cache.
func NewKeyCache() *KeyCache { return &KeyCache{keys: map[[sha256.Size]byte][]byte{}} }

// Close clears every key; the cache remembers nothing after it.
func (k *KeyCache) Close() {
	if k == nil {
		return
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	for id, key := range k.keys {
		clear(key)
		delete(k.keys, id)
	}
	k.keys = nil
}

// id is the cache's name for a header area unlocked with passphrase.
func keyID(area, passphrase []byte) [sha256.Size]byte {
	h := sha256.New()
	var n [8]byte
	for i, l := 0, uint64(len(passphrase)); i < 8; i++ {
		n[i] = byte(l >> (8 * i))
	}
	h.Write(n[:]) // (the length first: no two inputs hash alike)
	h.Write(passphrase)
	h.Write(area)
	var id [sha256.Size]byte
	h.Sum(id[:0])
	return id
}

// get returns a copy of the key remembered as id (the caller clears it),
// or nil.
func (k *KeyCache) get(id [sha256.Size]byte) []byte {
	k.mu.Lock()
	defer k.mu.Unlock()
	if key, ok := k.keys[id]; ok {
		return append([]byte(nil), key...)
	}
	return nil
}

// put remembers key (which the cache takes) as id.
func (k *KeyCache) put(id [sha256.Size]byte, key []byte) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.keys == nil || len(k.keys) >= maxCachedKeys {
		clear(key)
		return
	}
	if old, ok := k.keys[id]; ok {
		clear(old)
	}
	k.keys[id] = key
}
