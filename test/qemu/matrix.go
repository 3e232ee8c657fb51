package qemu

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// An Image is one qemu-made test image.
type Image struct {
	Name string // short, unique; usable as a file name stem
	Path string // the image file
}

// clusterSizes are the cluster sizes the matrix covers: qemu's minimum,
// a small one, its default, and its maximum.
var clusterSizes = []int{512, 4096, 65536, 2 << 20}

// Matrix builds the standard test matrix in dir with qemu-img and qemu-io:
// version 2 and 3 images at every cluster size with patterns written at
// unaligned offsets and across cluster boundaries, zero writes with and
// without unmap, discards; compressed images; qcow2-over-qcow2-over-raw
// chains where the overlay hides base data with zeros; an overlay larger
// than its base. The expected bytes of each image are whatever
// `qemu-img convert -O raw` makes of it.
func Matrix(t testing.TB, dir string) []Image {
	t.Helper()
	var out []Image
	add := func(name, path string) { out = append(out, Image{Name: name, Path: path}) }

	for _, compat := range []string{"0.10", "1.1"} {
		for _, cs := range clusterSizes {
			name := fmt.Sprintf("v%s-c%d", map[string]string{"0.10": "2", "1.1": "3"}[compat], cs)
			p := filepath.Join(dir, name+".qcow2")
			// A size that is not a multiple of the cluster size, with
			// room for a few clusters of every size.
			size := 24*cs + 8*(2<<20) + 3*512
			Create(t, "qcow2", p, fmt.Sprint(size), "-o", fmt.Sprintf("compat=%s,cluster_size=%d", compat, cs))
			IO(t, p, patternWrites(cs, size)...)
			add(name, p)
		}
	}

	// Compressed images from qemu-img convert -c, from a raw file with
	// patterns, plus a mixed image: compressed clusters rewritten in part.
	raw := filepath.Join(dir, "patterns.raw")
	Create(t, "raw", raw, "12M")
	rawIO(t, raw, patternWrites(65536, 12<<20)...)
	for _, ct := range []string{"zlib", "zstd"} {
		for _, cs := range []int{4096, 65536, 2 << 20} {
			name := fmt.Sprintf("compressed-%s-c%d", ct, cs)
			p := filepath.Join(dir, name+".qcow2")
			Img(t, "convert", "-q", "-c", "-O", "qcow2", "-o", fmt.Sprintf("cluster_size=%d,compression_type=%s", cs, ct), raw, p)
			add(name, p)
		}
		// Compressed clusters rewritten in part, zeroed, and written
		// compressed again by qemu-io.
		mixed := filepath.Join(dir, "compressed-mixed-"+ct+".qcow2")
		Img(t, "convert", "-q", "-c", "-O", "qcow2", "-o", "compression_type="+ct, raw, mixed)
		IO(t, mixed, "write -P 0x77 100000 5000", "write -z 1048576 65536", "write -c -P 0x55 4194304 65536")
		add("compressed-mixed-"+ct, mixed)
	}

	// A chain: raw base <- qcow2 middle <- qcow2 top. The top zeroes
	// some base data, writes some of its own, and is larger than the
	// middle, which is larger than the base.
	base := filepath.Join(dir, "chain-base.raw")
	Create(t, "raw", base, "6M")
	rawIO(t, base, "write -P 0xb1 0 6M")
	mid := filepath.Join(dir, "chain-mid.qcow2")
	Create(t, "qcow2", mid, "10M", "-b", filepath.Base(base), "-F", "raw", "-o", "cluster_size=4096")
	IO(t, mid, "write -P 0xc2 1M 1M", "write -z 3M 64k", "discard 5M 64k", "write -P 0xc3 7M 512")
	top := filepath.Join(dir, "chain-top.qcow2")
	Create(t, "qcow2", top, "16M", "-b", filepath.Base(mid), "-F", "qcow2")
	IO(t, top, "write -z 0 64k", "write -z -u 1536k 128k", "write -P 0xd4 2500000 70000", "write -P 0xd5 12M 4k")
	add("chain-top", top)
	add("chain-mid", mid)

	// v2 overlays over compressed v3 bases, deflate and zstd.
	for _, ct := range []string{"zlib", "zstd"} {
		cbase := filepath.Join(dir, "cbase-"+ct+".qcow2")
		Img(t, "convert", "-q", "-c", "-O", "qcow2", "-o", "compression_type="+ct, raw, cbase)
		cover := filepath.Join(dir, "over-compressed-"+ct+".qcow2")
		Create(t, "qcow2", cover, "20M", "-b", filepath.Base(cbase), "-F", "qcow2", "-o", "compat=0.10,cluster_size=512")
		IO(t, cover, "write -P 0xe6 65000 3000", "write -z 8M 1M")
		add("over-compressed-"+ct, cover)
	}

	// Extended L2 entries (subclusters), over a backing file so that
	// unallocated subclusters of allocated clusters read the backing
	// file: partial writes, zero writes with and without unmap, discards.
	for _, cs := range []int{16384, 65536, 2 << 20} {
		name := fmt.Sprintf("extl2-c%d", cs)
		base := filepath.Join(dir, name+"-base.qcow2")
		Create(t, "qcow2", base, "8M", "-o", fmt.Sprintf("cluster_size=%d", cs))
		IO(t, base, "write -P 0xaa 0 8M")
		p := filepath.Join(dir, name+".qcow2")
		Create(t, "qcow2", p, "12M", "-b", filepath.Base(base), "-F", "qcow2", "-o", fmt.Sprintf("extended_l2=on,cluster_size=%d", cs))
		sc := cs / 32
		IO(t, p,
			fmt.Sprintf("write -P 0x11 %d %d", sc, sc/2),      // part of one subcluster
			fmt.Sprintf("write -z %d %d", 3*sc+100, 2*sc),     // zero, keep
			fmt.Sprintf("write -z -u %d %d", cs+sc, 3*sc),     // zero, unmap
			fmt.Sprintf("discard %d %d", 2*cs, cs),            // whole cluster
			fmt.Sprintf("write -P 0x22 %d %d", 3*cs-sc/2, sc), // across clusters
			fmt.Sprintf("write -P 0x33 %d %d", 9<<20, 3*sc+5), // past the base
		)
		add(name, p)
	}

	// Internal snapshots: taken, then the image written, resized (so the
	// snapshots have other virtual sizes), snapshotted again.
	snap := filepath.Join(dir, "snapshots.qcow2")
	Create(t, "qcow2", snap, "8M", "-o", "cluster_size=4096")
	IO(t, snap, "write -P 0x81 0 1M", "write -P 0x82 5M 64k")
	Img(t, "snapshot", "-c", "first", snap)
	IO(t, snap, "write -P 0x83 512k 1M", "write -z 5M 4k")
	Img(t, "resize", "-q", snap, "12M")
	Img(t, "snapshot", "-c", "two/with slash", snap)
	IO(t, snap, "write -P 0x84 10M 100k", "discard 0 64k")
	add("snapshots", snap)

	// External data files, raw and not raw. (The name is absolute: qemu
	// resolves a relative data file name against its working folder,
	// not the image's.)
	for _, rawData := range []string{"on", "off"} {
		name := "datafile-raw-" + rawData
		p := filepath.Join(dir, name+".qcow2")
		data := filepath.Join(dir, name+".data")
		Create(t, "qcow2", p, "6M", "-o", fmt.Sprintf("data_file=%s,data_file_raw=%s", data, rawData))
		IO(t, p, "write -P 0x71 4096 70000", "write -z 1M 64k", "write -P 0x72 5M 512")
		add(name, p)
	}

	// Preallocated zero clusters (zero-alloc): a zero write without
	// unmap over a preallocated image.
	prealloc := filepath.Join(dir, "prealloc.qcow2")
	Create(t, "qcow2", prealloc, "8M", "-o", "preallocation=metadata")
	IO(t, prealloc, "write -P 0x99 0 3M", "write -z 1M 1M", "write -z -u 2560k 64k")
	add("prealloc", prealloc)
	settle()
	return out
}

// settle writes every dirty page back (sync), so that the images' host
// files are what they will stay: qemu's block status asks
// lseek(SEEK_DATA), which counts dirty pages as data, qcowfs asks FIEMAP
// after syncing the file, and qemu's preallocated-metadata detection goes
// by st_blocks, which delayed allocation changes at writeback.
func settle() { unix.Sync() }

// patternWrites returns qemu-io commands that exercise a disk of the given
// size and cluster size: patterns at unaligned offsets, writes across
// cluster boundaries, zero writes with and without unmap, discards.
func patternWrites(cs, size int) []string {
	return []string{
		"write -P 0x11 0 4096",
		fmt.Sprintf("write -P 0x22 %d 300", cs-100),          // across a boundary
		fmt.Sprintf("write -P 0x33 %d %d", 3*cs+7, 2*cs+11),  // unaligned, several clusters
		fmt.Sprintf("write -P 0x44 %d %d", 8*cs, 4*cs),       // then zeroed in part
		fmt.Sprintf("write -z %d %d", 9*cs, cs),              // zero, keep allocation
		fmt.Sprintf("write -z -u %d %d", 10*cs, cs),          // zero, unmap
		fmt.Sprintf("write -P 0x55 %d %d", 14*cs, 2*cs),      // then discarded
		fmt.Sprintf("discard %d %d", 15*cs, cs),              //
		fmt.Sprintf("write -P 0x66 %d 1M", 20*cs),            // a larger run
		fmt.Sprintf("write -P 0x67 %d 512", size-512),        // the last sector
		fmt.Sprintf("write -P 0x68 %d 1000", size-2*cs-3000), // near the end
	}
}

// rawIO runs qemu-io commands on a raw file.
func rawIO(t testing.TB, path string, cmds ...string) {
	t.Helper()
	formatIO(t, "raw", path, cmds...)
}

// TempDir returns a fresh folder for images; big files are better on a real
// disk than in a tmpfs /tmp, so TMPDIR is honoured by t.TempDir.
func TempDir(t testing.TB) string {
	t.Helper()
	d := t.TempDir()
	if err := os.Chmod(d, 0o755); err != nil {
		t.Fatal(err)
	}
	return d
}

// StatusMatrix is Matrix plus images made for block status: sparse
// disks with data far apart, preallocated images, a fragmented image, a
// disk with no data at all, a size that is not a multiple of the cluster.
func StatusMatrix(t testing.TB, dir string) []Image {
	images := Matrix(t, dir)
	add := func(name string, size string, opts []string, cmds ...string) {
		p := filepath.Join(dir, name+".qcow2")
		Create(t, "qcow2", p, size, opts...)
		if len(cmds) > 0 {
			IO(t, p, cmds...)
		}
		images = append(images, Image{Name: name, Path: p})
	}
	add("sparse-4T", "4T", nil, "write -P 1 0 1M", "write -P 2 1T 64k", "write -P 3 3000G 2M", "write -P 4 4398046510592 512")
	add("empty", "100M", nil)
	add("odd-size", "10000000", []string{"-o", "cluster_size=65536"}, "write -P 7 9960000 40000", "write -z 9900000 50000")
	add("prealloc-metadata", "64M", []string{"-o", "preallocation=metadata"}, "write -P 9 1M 100k", "write -P 9 40M 64k")
	add("prealloc-falloc", "64M", []string{"-o", "preallocation=falloc"}, "write -P 9 1M 100k")
	var backwards []string
	for i := 63; i >= 0; i-- {
		if i%3 != 0 {
			backwards = append(backwards, fmt.Sprintf("write -P %d %d 64k", i, i*65536))
		}
	}
	add("fragmented", "4M", nil, backwards...)
	// Let the host file system write back what qemu wrote: until then
	// its allocation (st_blocks, unwritten extents) is still moving, and
	// qemu's metadata-preallocation guess and host holes depend on it.
	unix.Sync()
	settle()
	return images
}

// FormImages are images of the fields and forms the matrix lacks, for the
// golden tests of info, map and check: dirty and corrupt bits, encryption
// (LUKS and legacy AES), raw files, a name that JSON must escape, zstd
// with 1-bit refcounts and an absolute backing name, files too short to
// be qcow2, a missing backing file. first is an image of the matrix
// (version 2): the backing file of two of them, and the head of the short
// ones.
func FormImages(t testing.TB, dir, first string) []Image {
	t.Helper()
	var out []Image
	add := func(name, path string) { out = append(out, Image{Name: name, Path: path}) }
	for _, c := range []struct {
		name string
		bit  byte
		opts []string
	}{{"dirty", 1, []string{"-o", "lazy_refcounts=on"}}, {"corrupt", 2, nil}} {
		p := filepath.Join(dir, c.name+".qcow2")
		Create(t, "qcow2", p, "1M", c.opts...)
		IO(t, p, "write -P 0x12 0 4k")
		SetIncompatible(t, p, c.bit)
		add(c.name, p)
	}
	for _, format := range []string{"luks", "aes"} {
		p := filepath.Join(dir, format+".qcow2")
		CreateEncrypted(t, p, format)
		add(format, p)
	}
	odd := filepath.Join(dir, "odd size.raw")
	if err := os.WriteFile(odd, bytes.Repeat([]byte("raw!"), 2500), 0o644); err != nil {
		t.Fatal(err)
	}
	add("raw-odd-size", odd)
	sparse := filepath.Join(dir, "sparse.raw")
	Create(t, "raw", sparse, "3M")
	add("raw-sparse", sparse)
	// A name with a space, a quote, a backslash and non-ASCII letters,
	// which qemu's JSON escapes its own way.
	strange := filepath.Join(dir, `vm "ü" \ 東.qcow2`)
	Create(t, "qcow2", strange, "1M", "-b", filepath.Base(first), "-F", "qcow2")
	add("strange-name", strange)
	// Other compression, refcount width and an absolute backing name.
	zstd := filepath.Join(dir, "zstd.qcow2")
	Create(t, "qcow2", zstd, "3M", "-o", "compression_type=zstd,refcount_bits=1,extended_l2=on,cluster_size=16384", "-b", first, "-F", "qcow2")
	add("zstd", zstd)
	// The first 4, 7 and 8 bytes of a version 2 image: the first two are
	// raw to qemu (the version reads as 0), the third a qcow2 image too
	// short to open.
	head, err := os.ReadFile(first)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{4, 7, 8} {
		p := filepath.Join(dir, fmt.Sprintf("short-%d.qcow2", n))
		if err := os.WriteFile(p, head[:n], 0o644); err != nil {
			t.Fatal(err)
		}
		add(fmt.Sprintf("short-%d", n), p)
	}
	orphan := filepath.Join(dir, "orphan.qcow2")
	Img(t, "create", "-q", "-u", "-f", "qcow2", "-b", "gone.qcow2", "-F", "qcow2", orphan, "1M")
	add("orphan", orphan)
	return out
}
