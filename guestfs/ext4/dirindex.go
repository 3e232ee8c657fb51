package ext4

import (
	"container/list"
	"sync"
)

// A linear directory (no htree: ext2, or any directory mkfs.ext4 -d made)
// is searched entry by entry, so looking up each of its n names costs n²;
// the kernel's dentry cache hides that, and this is ours: the first lookup
// in a linear directory of more than one block reads all its names into a
// map, which later lookups use. The maps are kept least recently used
// first, up to maxIndexedNames names in all; a directory with more is
// searched entry by entry every time.
const maxIndexedNames = 1 << 17

type dirIndexes struct {
	mu    sync.Mutex
	byIno map[uint64]*list.Element // of *dirIndex
	lru   list.List                // front: most recently used
	names int
}

type dirIndex struct {
	ino   uint64
	names map[string]uint32
}

// lookupIndexed finds name in linear directory dir through its index,
// made now if need be. ok is false when dir is too large to index.
func (fs *FS) lookupIndexed(dir *inode, name string) (ino uint32, found, ok bool, err error) {
	x := &fs.indexes
	x.mu.Lock()
	if e, hit := x.byIno[dir.ino]; hit {
		x.lru.MoveToFront(e)
		ino, found = e.Value.(*dirIndex).names[name]
		x.mu.Unlock()
		return ino, found, true, nil
	}
	x.mu.Unlock()

	names := map[string]uint32{}
	tooMany := false
	err = fs.forEachEntry(dir, func(i uint32, n []byte, _ uint8) bool {
		if len(names) >= maxIndexedNames {
			tooMany = true
			return false
		}
		if _, dup := names[string(n)]; !dup { // the first entry of a name is the one found
			names[string(n)] = i
		}
		return true
	})
	if err != nil || tooMany {
		return 0, false, false, err
	}
	ino, found = names[name]

	x.mu.Lock()
	defer x.mu.Unlock()
	if x.byIno == nil {
		x.byIno = map[uint64]*list.Element{}
	}
	if _, hit := x.byIno[dir.ino]; !hit {
		x.byIno[dir.ino] = x.lru.PushFront(&dirIndex{ino: dir.ino, names: names})
		x.names += len(names)
		for x.names > maxIndexedNames {
			old := x.lru.Remove(x.lru.Back()).(*dirIndex)
			delete(x.byIno, old.ino)
			x.names -= len(old.names)
		}
	}
	return ino, found, true, nil
}
