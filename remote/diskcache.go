package remote

import (
	"container/list"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// diskCache keeps chunks in files, one per chunk, under
// dir/qcowfs-remote-v1/OBJECT/INDEX, where OBJECT is a hash of the object's
// URL (without userinfo), version, size and the chunk size: a replaced
// object, or another chunk size, never finds the old files. Each file is
// the chunk's bytes followed by a trailer of their length and CRC-32C, and
// is written to a temporary name and renamed, so a crash or a full disk
// leaves either a whole chunk or none, and a damaged file is dropped when
// read.
//
// The total size of the files stays within limit: the least recently used
// file is removed first. Recency is kept in memory and starts, for files
// left by an earlier run, from their modification times.
//
// mu guards lru, files and used; file I/O happens without it. Two
// goroutines never write one chunk at once: the memory cache lets one
// fetch per chunk run.
type diskCache struct {
	root  string
	limit int64
	log   *slog.Logger

	mu    sync.Mutex
	lru   *list.List               // of *diskEntry, most recent first
	files map[string]*list.Element // by path relative to root
	used  int64
	// failing counts the writes that failed since the last one that
	// did not: a full disk fails every write, and is logged once
	// (put).
	failing int
}

type diskEntry struct {
	rel  string
	size int64
}

const diskTrailer = 8 // uint32 length, uint32 CRC-32C, little-endian

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

func openDiskCache(dir string, limit int64, log *slog.Logger) (*diskCache, error) {
	root := filepath.Join(dir, "qcowfs-remote-v1")
	if err := os.MkdirAll(root, 0o700); err != nil {
		return nil, fmt.Errorf("remote: cache dir: %w", err)
	}
	d := &diskCache{root: root, limit: limit, log: log, lru: list.New(), files: map[string]*list.Element{}}
	type found struct {
		rel   string
		size  int64
		mtime time.Time
	}
	var all []found
	err := filepath.WalkDir(root, func(path string, e fs.DirEntry, err error) error {
		if err != nil || e.IsDir() {
			return err
		}
		if strings.HasSuffix(path, ".tmp") { // a write cut short
			os.Remove(path)
			return nil
		}
		info, err := e.Info()
		if err != nil {
			return nil
		}
		rel, _ := filepath.Rel(root, path)
		all = append(all, found{rel, info.Size(), info.ModTime()})
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("remote: cache dir: %w", err)
	}
	slices.SortFunc(all, func(a, b found) int { return a.mtime.Compare(b.mtime) })
	for _, f := range all { // oldest first, so the newest ends in front
		d.files[f.rel] = d.lru.PushFront(&diskEntry{f.rel, f.size})
		d.used += f.size
	}
	d.mu.Lock()
	d.trim()
	d.mu.Unlock()
	return d, nil
}

// objectDir names the folder of one object version's chunks.
func objectDir(url, version string, size, chunk int64) string {
	h := sha256.Sum256([]byte(fmt.Sprintf("%s\x00%s\x00%d\x00%d", url, version, size, chunk)))
	return hex.EncodeToString(h[:16])
}

func chunkRel(obj string, idx int64) string {
	return filepath.Join(obj, strconv.FormatInt(idx, 16))
}

// get reads chunk idx of obj into buf and returns its length, or false if
// the cache does not hold it whole and intact.
func (d *diskCache) get(obj string, idx int64, buf []byte) (int, bool) {
	rel := chunkRel(obj, idx)
	d.mu.Lock()
	e := d.files[rel]
	if e != nil {
		d.lru.MoveToFront(e)
	}
	d.mu.Unlock()
	if e == nil {
		return 0, false
	}
	f, err := os.Open(filepath.Join(d.root, rel))
	if err != nil {
		d.remove(rel)
		return 0, false
	}
	defer f.Close()
	size := e.Value.(*diskEntry).size
	n := size - diskTrailer
	if n <= 0 || n > int64(len(buf)) {
		d.bad(rel, "size %d", size)
		return 0, false
	}
	var tr [diskTrailer]byte
	if _, err := f.ReadAt(buf[:n], 0); err != nil {
		d.bad(rel, "read: %v", err)
		return 0, false
	}
	if _, err := f.ReadAt(tr[:], n); err != nil {
		d.bad(rel, "read trailer: %v", err)
		return 0, false
	}
	if l, sum := binary.LittleEndian.Uint32(tr[:4]), binary.LittleEndian.Uint32(tr[4:]); int64(l) != n || sum != crc32.Checksum(buf[:n], castagnoli) {
		d.bad(rel, "length %d or checksum %#x does not match", l, sum)
		return 0, false
	}
	return int(n), true
}

// has reports whether the cache holds chunk idx of obj (without reading
// it: a damaged file is found when a read gets it).
func (d *diskCache) has(obj string, idx int64) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.files[chunkRel(obj, idx)] != nil
}

func (d *diskCache) bad(rel, format string, args ...any) {
	d.log.Warn("remote: dropping damaged disk cache file", "file", filepath.Join(d.root, rel), "why", fmt.Sprintf(format, args...))
	d.remove(rel)
}

// put stores data as chunk idx of obj, and returns why it could not. A
// reader's fetch ignores the failure (the cache is only a cache); a
// hydration stops at it. Failures are logged once, until a write
// succeeds again: a full disk fails every write after the first.
func (d *diskCache) put(obj string, idx int64, data []byte) error {
	rel := chunkRel(obj, idx)
	path := filepath.Join(d.root, rel)
	size := int64(len(data)) + diskTrailer
	if size > d.limit {
		return fmt.Errorf("a chunk of %d bytes is larger than the disk cache (%d)", size, d.limit)
	}
	if err := d.write(path, data); err != nil {
		if errors.Is(err, syscall.ENOSPC) {
			err = fmt.Errorf("disk cache %s: its file system is full: %w", filepath.Dir(d.root), syscall.ENOSPC)
		} else {
			err = fmt.Errorf("disk cache %s: %w", filepath.Dir(d.root), err)
		}
		d.mu.Lock()
		d.failing++
		first := d.failing == 1
		d.mu.Unlock()
		if first {
			d.log.Warn("remote: cannot write the disk cache; chunks are not kept on disk until it can (logged once)", "file", path, "err", err)
		}
		return err
	}
	d.mu.Lock()
	if d.failing > 0 {
		d.log.Info("remote: the disk cache is written again", "failed writes", d.failing)
		d.failing = 0
	}
	if e := d.files[rel]; e != nil {
		d.used -= e.Value.(*diskEntry).size
		d.lru.Remove(e)
	}
	d.files[rel] = d.lru.PushFront(&diskEntry{rel, size})
	d.used += size
	d.trim()
	d.mu.Unlock()
	return nil
}

func (d *diskCache) write(path string, data []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	// A file of its own: a reader's fetch and a hydration may put the
	// same chunk at once, and one must not truncate the other's file
	// under it.
	f, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".*.tmp")
	if err != nil {
		return err
	}
	tmp := f.Name()
	var tr [diskTrailer]byte
	binary.LittleEndian.PutUint32(tr[:4], uint32(len(data)))
	binary.LittleEndian.PutUint32(tr[4:], crc32.Checksum(data, castagnoli))
	_, err = f.Write(data)
	if err == nil {
		_, err = f.Write(tr[:])
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
	}
	return err
}

// trim removes the least recently used files until used fits the limit.
// Called with mu held; removing a file is one unlink, cheap enough to do
// under the lock.
func (d *diskCache) trim() {
	for d.used > d.limit {
		e := d.lru.Back()
		ent := e.Value.(*diskEntry)
		d.lru.Remove(e)
		delete(d.files, ent.rel)
		d.used -= ent.size
		os.Remove(filepath.Join(d.root, ent.rel))
		os.Remove(filepath.Dir(filepath.Join(d.root, ent.rel))) // only if empty
	}
}

func (d *diskCache) remove(rel string) {
	d.mu.Lock()
	if e := d.files[rel]; e != nil {
		d.used -= e.Value.(*diskEntry).size
		d.lru.Remove(e)
		delete(d.files, rel)
	}
	d.mu.Unlock()
	os.Remove(filepath.Join(d.root, rel))
}

// usage returns the bytes of files in the cache.
func (d *diskCache) usage() int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.used
}
