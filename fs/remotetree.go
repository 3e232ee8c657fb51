package fs

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"os"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/qcowfs/qcowfs/internal/remotefile"
	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/remote"
)

// A remote source: the objects under an s3://BUCKET/PREFIX/ in folders
// mirroring their keys, or one image at an http(s):// or s3:// URL (a
// folder showing only that file, like a local single image).
//
// The tree is a listing, made at mount time (a failure there, a wrong key
// say, fails the mount) and made again by the first lookup or listing
// after it is RemoteRefresh old (other requests meanwhile get the last
// listing); a refresh that fails keeps the last listing, with one log line
// until one succeeds again. For one image the
// "listing" is an open of the object, which learns its size and ETag.
//
// Objects are shown only if they are qcow2 images (by their magic bytes):
// other objects cannot be served as plain files without a descriptor, and
// are still read as backing files. Remote images are only read: a
// writable mount writes their overlays (overlay.go).
//
// The tree keeps every object it opened open (held), and hands out shared
// Files over them: the chunks the Client caches for an object live as
// long as one Object of its version is open, so the header and tables
// read when an image is listed are still cached when it is read, however
// often the registry closes and opens the image. A held object is let go
// when the listing shows another version of it (or none), and held
// objects nobody uses are closed when there are more than maxHeld.
//
// Stats are made up (see tree.go): the tree's own device number, an inode
// number hashed from the URL, the size, the listing's modification time,
// and a hash of the ETag in the change time's nanoseconds, so that a
// replaced object is a new generation (identity.go) with a new node.
type remoteTree struct {
	c        *remote.Client
	writable bool   // a writable overlay mount: images show write permission
	base     string // the folder's URL, with its trailing slash
	single   string // one image: its URL ("" for a prefix)
	shown    string // base, redacted, for messages
	refresh  time.Duration
	log      *slog.Logger
	dev      uint64
	uid      uint32
	gid      uint32
	started  time.Time
	opener   *remotefile.Opener
	allowed  []string

	listMu sync.Mutex // held while listing: one refresh at a time (TryLock)

	mu      sync.Mutex // guards what follows; no I/O under it
	cur     *listing
	listed  time.Time
	failing bool                   // the last refresh failed (logged)
	held    map[string]*heldObject // open objects, by URL
	probed  map[probeKey]bool      // qcow2 magic seen, by object version
}

// listing is one listing of the tree, never changed once made.
type listing struct {
	objects map[string]remoteObject // by path relative to the root
	dirs    map[string]*remoteDir   // by path; "" is the root
	byURL   map[string]string       // object URL -> path
}

type remoteObject struct {
	url   string
	size  int64
	etag  string
	mtime time.Time
}

type remoteDir struct {
	children []string // names, sorted
	ver      uint64   // a hash of the children's names, sizes and ETags
}

// heldObject is an object the tree keeps open; refs counts the Files
// handed out over it.
type heldObject struct {
	o       *remote.Object
	refs    int
	dropped bool // no longer in held: closed by the last release
}

type probeKey struct {
	url, etag string
	size      int64
}

// maxHeld bounds the objects held open that no image uses.
const maxHeld = 1024

// defaultRemoteRefresh is how long a listing serves by default.
const defaultRemoteRefresh = 30 * time.Second

var _ tree = (*remoteTree)(nil)

// openRemoteTree lists a remote source for the first time. It returns the
// tree and, for a single image, the name the root folder shows.
func openRemoteTree(cfg Config) (*remoteTree, string, error) {
	if cfg.Remote == nil {
		return nil, "", errors.New("remote source without a remote client")
	}
	src := cfg.Source
	t := &remoteTree{
		c: cfg.Remote, writable: cfg.Writable, refresh: cfg.RemoteRefresh, log: cfg.Log,
		uid: uint32(os.Getuid()), gid: uint32(os.Getgid()), started: time.Now(),
		held: map[string]*heldObject{}, probed: map[probeKey]bool{},
	}
	if t.refresh <= 0 {
		t.refresh = defaultRemoteRefresh
	}
	only := ""
	if remotefile.IsPrefix(src) {
		t.base = src
		if !strings.HasSuffix(t.base, "/") {
			t.base += "/"
		}
	} else {
		if strings.HasSuffix(src, "/") {
			return nil, "", fmt.Errorf("%s: an http(s) source names one image; only s3:// prefixes can be listed", remote.Redact(src))
		}
		t.single = src
		t.base = remotefile.Folder(src)
		only = strings.TrimPrefix(src, t.base)
		if i := strings.IndexAny(only, "?#"); i >= 0 {
			only = only[:i]
		}
	}
	t.shown = remote.Redact(t.base)
	h := fnv.New64a()
	h.Write([]byte(t.shown))
	t.dev = h.Sum64() | 1<<62
	t.allowed = append([]string{t.base}, cfg.AllowBackingURLs...)
	t.opener = &remotefile.Opener{OpenURL: t.openURL, Allowed: t.allowed}
	l, err := t.list()
	if err != nil {
		return nil, "", err
	}
	if t.single != "" {
		if _, ok := l.objects[only]; !ok {
			return nil, "", fmt.Errorf("%s: no such object (to mount the objects under a prefix, end the URL with a slash)", remote.Redact(src))
		}
	}
	t.cur, t.listed = l, time.Now()
	return t, only, nil
}

// list makes a new listing.
func (t *remoteTree) list() (*listing, error) {
	ctx := context.Background()
	l := &listing{objects: map[string]remoteObject{}, dirs: map[string]*remoteDir{}, byURL: map[string]string{}}
	if t.single != "" {
		name := strings.TrimPrefix(t.single, t.base)
		if i := strings.IndexAny(name, "?#"); i >= 0 {
			name = name[:i]
		}
		if strings.HasPrefix(t.single, "s3://") && !t.c.Options().Offline {
			entries, err := t.c.List(ctx, t.single)
			if err != nil {
				return nil, err
			}
			for _, e := range entries {
				if e.Name == "" {
					l.add(name, remoteObject{url: t.single, size: e.Size, etag: e.ETag, mtime: e.ModTime})
				}
			}
		} else {
			// A web server has no listing (and offline, nothing
			// is listed): open the object, which learns its size
			// and ETag; the object stays held.
			o, err := t.c.Open(ctx, t.single)
			if err != nil {
				return nil, err
			}
			l.add(name, remoteObject{url: t.single, size: o.Size(), etag: o.ETag(), mtime: t.started})
			t.hold(t.single, o)
		}
		l.finish()
		return l, nil
	}
	entries, err := t.c.List(ctx, t.base)
	if err != nil {
		return nil, err
	}
	for _, e := range entries {
		rel, ok := keyPath(e.Name)
		if !ok {
			if !strings.HasSuffix(e.Name, "/") {
				t.log.Debug("object not shown: its key does not make a path", "url", remote.Redact(e.URL))
			}
			continue
		}
		l.add(rel, remoteObject{url: e.URL, size: e.Size, etag: e.ETag, mtime: e.ModTime})
	}
	l.finish()
	return l, nil
}

// keyPath turns a key (with the listing's prefix cut off) into a path:
// slash-separated names, none empty, "." or "..", or longer than 255 bytes.
func keyPath(name string) (string, bool) {
	if name == "" || strings.ContainsRune(name, 0) {
		return "", false
	}
	for seg := range strings.SplitSeq(name, "/") {
		if seg == "" || seg == "." || seg == ".." || len(seg) > 255 {
			return "", false
		}
	}
	return name, true
}

func (l *listing) add(rel string, o remoteObject) {
	l.objects[rel] = o
	l.byURL[o.url] = rel
}

// finish makes the folders of the listing's objects. A name that is both
// an object and a folder ("a" and "a/b") is a folder.
func (l *listing) finish() {
	l.dirs[""] = &remoteDir{}
	children := map[string]map[string]bool{"": {}}
	for rel := range l.objects {
		for p := rel; p != ""; {
			parent, name := "", p
			if i := strings.LastIndexByte(p, '/'); i >= 0 {
				parent, name = p[:i], p[i+1:]
			}
			if children[parent] == nil {
				children[parent] = map[string]bool{}
			}
			seen := children[parent][name]
			children[parent][name] = true
			if seen {
				break
			}
			p = parent
		}
	}
	for dir := range children {
		if o, ok := l.objects[dir]; ok && dir != "" {
			delete(l.objects, dir)
			delete(l.byURL, o.url)
		}
	}
	for dir, names := range children {
		d := &remoteDir{}
		for n := range names {
			d.children = append(d.children, n)
		}
		sort.Strings(d.children)
		h := fnv.New64a()
		for _, n := range d.children {
			fmt.Fprintf(h, "%s\x00", n)
			if o, ok := l.objects[join(dir, n)]; ok {
				fmt.Fprintf(h, "%d\x00%s\x00", o.size, o.etag)
			}
		}
		d.ver = h.Sum64()
		l.dirs[dir] = d
	}
}

// current returns the listing, made again if it is older than the refresh
// interval. A failed refresh keeps the old listing and is logged once.
func (t *remoteTree) current() *listing {
	t.mu.Lock()
	l, fresh := t.cur, time.Since(t.listed) < t.refresh
	t.mu.Unlock()
	if fresh {
		return l
	}
	if !t.listMu.TryLock() {
		// Someone is listing: the last listing serves meanwhile, so
		// that a slow server holds up one request, not every lookup.
		return l
	}
	defer t.listMu.Unlock()
	t.mu.Lock()
	l, fresh = t.cur, time.Since(t.listed) < t.refresh
	t.mu.Unlock()
	if fresh {
		return l // listed meanwhile
	}
	nl, err := t.list()
	t.mu.Lock()
	defer t.mu.Unlock()
	t.listed = time.Now()
	if err != nil {
		if !t.failing {
			t.log.Warn("listing the remote source failed; showing the last listing until a refresh succeeds", "source", t.shown, "err", err)
		}
		t.failing = true
		return t.cur
	}
	if t.failing {
		t.log.Info("listing the remote source works again", "source", t.shown)
		t.failing = false
	}
	// Let go of objects replaced or gone.
	for url, h := range t.held {
		rel, ok := nl.byURL[url]
		if !ok {
			if _, wasListed := t.cur.byURL[url]; !wasListed {
				continue // a backing file from outside the listing
			}
		} else if o := nl.objects[rel]; o.etag == h.o.ETag() && o.size == h.o.Size() {
			continue
		}
		t.dropLocked(url, h)
	}
	t.cur = nl
	return nl
}

// dropLocked stops holding the object at url; its last user closes it.
func (t *remoteTree) dropLocked(url string, h *heldObject) {
	delete(t.held, url)
	h.dropped = true
	if h.refs == 0 {
		go h.o.Close()
	}
}

// hold keeps o open as the object at url, replacing (and letting go of) an
// older one.
func (t *remoteTree) hold(url string, o *remote.Object) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if h := t.held[url]; h != nil {
		if h.o.ETag() == o.ETag() && h.o.Size() == o.Size() && h.o.Version() == o.Version() {
			go o.Close() // the same version: the held one serves
			return
		}
		t.dropLocked(url, h)
	}
	t.held[url] = &heldObject{o: o}
	t.trimLocked()
}

// trimLocked closes held objects nobody uses when there are too many.
func (t *remoteTree) trimLocked() {
	if len(t.held) <= maxHeld {
		return
	}
	for url, h := range t.held {
		if h.refs == 0 {
			t.dropLocked(url, h)
		}
	}
}

// openURL returns a File over the object at url, held open.
func (t *remoteTree) openURL(ctx context.Context, url string) (*remotefile.File, error) {
	t.mu.Lock()
	h := t.held[url]
	if h == nil {
		t.mu.Unlock()
		o, err := t.c.Open(ctx, url)
		if err != nil {
			return nil, err
		}
		t.hold(url, o)
		t.mu.Lock()
		if h = t.held[url]; h == nil {
			// (Trimmed at once: only if maxHeld are in use.)
			t.mu.Unlock()
			return remotefile.Shared(o, url, func() { o.Close() }), nil
		}
	}
	h.refs++
	t.mu.Unlock()
	var once sync.Once
	return remotefile.Shared(h.o, url, func() {
		once.Do(func() {
			t.mu.Lock()
			h.refs--
			last := h.refs == 0 && h.dropped
			t.mu.Unlock()
			if last {
				h.o.Close()
			}
		})
	}), nil
}

func (t *remoteTree) abs(rel string) string {
	if t.single != "" && rel != "" {
		return remote.Redact(t.single)
	}
	return t.shown + rel
}

// urlOf is the URL of the object at rel, as given or listed ("" if the
// listing has none).
func (t *remoteTree) urlOf(rel string) string {
	if t.single != "" {
		return t.single
	}
	return t.current().objects[rel].url
}

// backingName is the URL of the object at rel without its userinfo: qemu
// opens an http(s) one as it is (curl driver), and no password is
// written into the overlay.
func (t *remoteTree) backingName(rel string) string { return remote.WithoutUserinfo(t.urlOf(rel)) }

// names compares by object: another password, or another signature of
// a presigned URL, names the same object.
func (t *remoteTree) names(rel, name string) bool { return remote.SameObject(name, t.urlOf(rel)) }

func (t *remoteTree) notFound(op, rel string) error {
	return &os.PathError{Op: op, Path: t.abs(rel), Err: syscall.ENOENT}
}

func (t *remoteTree) folder(rel string) (folder, error) {
	l := t.current()
	d := l.dirs[rel]
	if d == nil {
		return nil, t.notFound("open", rel)
	}
	return &remoteFolder{t: t, l: l, rel: rel, d: d}, nil
}

// remoteFolder is a folder of one listing.
type remoteFolder struct {
	t   *remoteTree
	l   *listing
	rel string
	d   *remoteDir
}

func (f *remoteFolder) stat() (syscall.Stat_t, error) { return f.t.dirStat(f.rel, f.d), nil }

func (f *remoteFolder) names() ([]string, error) { return f.d.children, nil }

func (f *remoteFolder) lstat(name string) (syscall.Stat_t, error) {
	return f.t.statIn(f.l, join(f.rel, name))
}

func (f *remoteFolder) Close() error { return nil }

func (t *remoteTree) stat(rel string) (syscall.Stat_t, error) {
	return t.statIn(t.current(), rel)
}

func (t *remoteTree) statIn(l *listing, rel string) (syscall.Stat_t, error) {
	if d := l.dirs[rel]; d != nil {
		return t.dirStat(rel, d), nil
	}
	if o, ok := l.objects[rel]; ok {
		return t.objStat(o), nil
	}
	return syscall.Stat_t{}, t.notFound("stat", rel)
}

func (t *remoteTree) dirStat(rel string, d *remoteDir) syscall.Stat_t {
	h := fnv.New64a()
	h.Write([]byte(t.base + rel + "/"))
	return syscall.Stat_t{
		Dev: t.dev, Ino: h.Sum64(), Nlink: 2, Mode: syscall.S_IFDIR | 0o555,
		Uid: t.uid, Gid: t.gid, Size: int64(len(d.children)), Blksize: 4096,
		Mtim: syscall.NsecToTimespec(t.started.UnixNano()),
		Ctim: syscall.Timespec{Sec: t.started.Unix(), Nsec: int64(d.ver % 1e9)},
	}
}

func (t *remoteTree) objStat(o remoteObject) syscall.Stat_t {
	h := fnv.New64a()
	h.Write([]byte(o.url))
	e := fnv.New64a()
	e.Write([]byte(o.etag))
	mode := uint32(syscall.S_IFREG | 0o444)
	if t.writable {
		mode |= 0o200 // written through overlays, by the mount's owner
	}
	return syscall.Stat_t{
		Dev: t.dev, Ino: h.Sum64(), Nlink: 1, Mode: mode,
		Uid: t.uid, Gid: t.gid, Size: o.size, Blocks: (o.size + 511) / 512, Blksize: 1 << 16,
		Mtim: syscall.NsecToTimespec(o.mtime.UnixNano()),
		Ctim: syscall.Timespec{Sec: o.mtime.Unix(), Nsec: int64(e.Sum64() % 1e9)},
	}
}

func (t *remoteTree) resolveLink(rel string) (string, error) {
	return "", fmt.Errorf("%s: remote sources have no symlinks", t.abs(rel))
}

// probe reads the object's first bytes (probeHead), once per version.
// An object that begins with qcow2's magic but is no qcow2 image to qemu
// is logged then: only images are shown.
func (t *remoteTree) probe(rel string) (isQcow2, magic bool) {
	l := t.current()
	o, ok := l.objects[rel]
	if !ok {
		return false, false
	}
	k := probeKey{o.url, o.etag, o.size}
	t.mu.Lock()
	is, known := t.probed[k]
	t.mu.Unlock()
	if known {
		return is, false // (logged when probed)
	}
	f, err := t.openURL(context.Background(), o.url)
	if err != nil {
		t.log.Warn("object not shown: it cannot be read", "url", remote.Redact(o.url), "err", err)
		return false, false
	}
	defer f.Close()
	is, magic = probeHead(f)
	if !is && magic {
		t.log.Warn("object not shown: it begins with the qcow2 magic, but qemu reads it as a raw file (a version of 0: cut short, or damaged)",
			"url", remote.Redact(o.url), "size", o.size)
	}
	t.mu.Lock()
	if len(t.probed) >= maxIdentities {
		clear(t.probed)
	}
	t.probed[k] = is
	t.mu.Unlock()
	return is, false
}

// counts says how many objects the current listing has, and how many of
// them were probed (probe) and found to be qcow2 images.
func (t *remoteTree) counts() (objects, images int) {
	l := t.current()
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, o := range l.objects {
		if t.probed[probeKey{o.url, o.etag, o.size}] {
			images++
		}
	}
	return len(l.objects), images
}

// showsPlain is false: plain files are not shown (there is no descriptor
// to serve them from).
func (t *remoteTree) showsPlain() bool { return false }

func (t *remoteTree) openImage(rel string, write bool) (qcow2.HostFile, syscall.Stat_t, error) {
	if write {
		return nil, syscall.Stat_t{}, &os.PathError{Op: "open", Path: t.abs(rel), Err: syscall.EROFS}
	}
	l := t.current()
	o, ok := l.objects[rel]
	if !ok {
		return nil, syscall.Stat_t{}, t.notFound("open", rel)
	}
	f, err := t.openURL(context.Background(), o.url)
	if err != nil {
		return nil, syscall.Stat_t{}, err
	}
	st, _ := t.fileStat(f)
	return f, st, nil
}

// fileStat makes the stat of an open object: the listing's modification
// time if the listing shows this version of it.
func (t *remoteTree) fileStat(f qcow2.HostFile) (syscall.Stat_t, error) {
	rf, ok := f.(*remotefile.File)
	if !ok {
		return syscall.Stat_t{}, errors.New("not a remote object")
	}
	o := remoteObject{url: rf.RawURL(), size: rf.Object.Size(), etag: rf.ETag()}
	t.mu.Lock()
	l := t.cur
	t.mu.Unlock()
	if rel, ok := l.byURL[o.url]; ok {
		if lo := l.objects[rel]; lo.etag == o.etag && lo.size == o.size {
			o.mtime = lo.mtime
		}
	}
	return t.objStat(o), nil
}

func (t *remoteTree) openPlain(rel string) (*os.File, error) {
	return nil, &os.PathError{Op: "open", Path: t.abs(rel), Err: syscall.EOPNOTSUPP}
}

// statfs reports the objects of the last listing, as a read-only file
// system of their size would: the bytes they hold as its size, all of it
// used and none free, and their number as its files. So df shows how
// much the source holds (every object under the prefix, images or not;
// for one image, that image's object).
func (t *remoteTree) statfs(st *syscall.Statfs_t) error {
	t.mu.Lock()
	l := t.cur
	t.mu.Unlock()
	const bs = 4096
	*st = syscall.Statfs_t{Bsize: bs, Frsize: bs, Namelen: 255}
	if l != nil {
		var bytes int64
		for _, o := range l.objects {
			bytes += o.size
		}
		st.Blocks = uint64((bytes + bs - 1) / bs)
		st.Files = uint64(len(l.objects))
	}
	return nil
}

// configure makes backing and data files open through the tree, by URL,
// under the mounted prefix or an allowed one.
func (t *remoteTree) configure(o *qcow2.Options) {
	o.Opener = t.opener
	o.AllowedDirs = nil
}

// close closes every held object.
func (t *remoteTree) close() {
	t.mu.Lock()
	for url, h := range t.held {
		delete(t.held, url)
		h.dropped = true
		h.o.Close()
	}
	t.mu.Unlock()
}
