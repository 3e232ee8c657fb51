package fat

import (
	"bytes"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"testing/fstest"
	"time"

	"github.com/qcowfs/qcowfs/guestfs"
)

// The oracles: the source tree that mcopy -s -m copied in (bytes, sizes,
// names, mtimes to FAT's 2 s), mtools' own view of the image (mdir's
// listing, mtype's bytes, minfo's geometry), fsck.fat's verdict that
// mtools made a sound file system, and Linux's vfat rules for what the
// tree cannot say (modes, nlink, blocks: doc.go). mtools runs with TZ=UTC,
// so that the local times it writes are the UTC times Linux reads.

// need fails the test under CI=true if a tool is missing, else skips it.
func need(t testing.TB, tools ...string) {
	t.Helper()
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("%s is required under CI=true: %v", tool, err)
			}
			t.Skipf("%s not installed: %v", tool, err)
		}
	}
}

func tool(t testing.TB, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Env = append(os.Environ(), "TZ=UTC", "LC_ALL=C.UTF-8")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %q: %v\n%s", name, args, err, out)
	}
	return string(out)
}

// treeOpts says what genTree makes besides the common files.
type treeOpts struct {
	many int   // files in one directory
	deep int   // nested directories
	big  int64 // bytes of the largest file
}

// genTree writes the source tree for a file system of clusters of cs
// bytes: sizes around the cluster size, long, Unicode and 8.3 names (some
// lower case, which mtools stores as NT case flags), nesting, a crowded
// directory, a file made read-only afterwards (readonly.txt), and mtimes
// on odd and even seconds.
func genTree(t *testing.T, cs int64, o treeOpts) string {
	root := filepath.Join(t.TempDir(), "tree")
	rng := rand.New(rand.NewPCG(uint64(cs), 46))
	stamp := time.Date(2020, 2, 29, 12, 34, 56, 0, time.UTC)
	var files []string
	write := func(rel string, n int64) {
		p := filepath.Join(root, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		files = append(files, p)
	}
	for _, n := range []int64{0, 1, cs - 1, cs, cs + 1, 2*cs + 1, o.big} {
		write(fmt.Sprintf("size%d.bin", n), n)
	}
	for _, name := range []string{
		"Long file name with spaces.text", "a.b.c.d", "naïve café, déjà vu.txt",
		"漢字テスト.txt", "Ünïcödé Ordner/ñ.txt", "lower.txt", "UPPER.TXT", "MiXeD.TxT",
		"lowbase.TXT", "UPBASE.txt", "x", "café.txt", "name.with.many.dots and a long extension",
		"case/Case.txt", "readonly.txt", "sub/inner/file.dat",
		strings.Repeat("L", 200) + ".txt",
	} {
		write(name, int64(len(name)))
	}
	deep := "deep"
	for i := 1; i <= o.deep; i++ {
		deep = filepath.Join(deep, fmt.Sprintf("d%02d", i))
	}
	if o.deep > 0 {
		write(filepath.Join(deep, "bottom.txt"), 7)
	}
	for i := 0; i < o.many; i++ {
		write(fmt.Sprintf("many/f%05d.txt", i), int64(i%3))
	}
	if err := os.MkdirAll(filepath.Join(root, "empty dir"), 0o755); err != nil {
		t.Fatal(err)
	}
	// Children before parents, so a directory's mtime outlives the
	// files made in it.
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			files = append(files, p)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.SortStableFunc(files, func(a, b string) int { return strings.Count(b, "/") - strings.Count(a, "/") })
	for i, p := range files {
		ts := stamp.Add(time.Duration(i*7) * time.Second)
		if err := os.Chtimes(p, ts, ts); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

// makeImage makes a file system with mkfs.fat args over kib KiB, copies
// tree into it with mcopy -s -m, makes readonly.txt read-only with
// mattrib, and checks it with fsck.fat.
func makeImage(t *testing.T, tree string, kib int, args ...string) string {
	img := filepath.Join(t.TempDir(), "fat.img")
	tool(t, "mkfs.fat", append(append([]string{"-C", "-n", "GUEST46"}, args...), img, strconv.Itoa(kib))...)
	ents, err := os.ReadDir(tree)
	if err != nil {
		t.Fatal(err)
	}
	mc := []string{"-s", "-m", "-i", img}
	for _, e := range ents {
		mc = append(mc, filepath.Join(tree, e.Name()))
	}
	tool(t, "mcopy", append(mc, "::")...)
	tool(t, "mattrib", "-i", img, "+r", "::/readonly.txt")
	tool(t, "fsck.fat", "-n", img)
	return img
}

func openImage(t testing.TB, img string) *FS {
	fh, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fh.Close() })
	st, err := fh.Stat()
	if err != nil {
		t.Fatal(err)
	}
	f, err := Open(fh, st.Size())
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// clusterSize is the image's cluster size as minfo reports it.
func clusterSize(t *testing.T, img string) int64 {
	out := tool(t, "minfo", "-i", img, "::")
	sec := regexp.MustCompile(`sector size: (\d+) bytes`).FindStringSubmatch(out)
	spc := regexp.MustCompile(`cluster size: (\d+) sectors`).FindStringSubmatch(out)
	if sec == nil || spc == nil {
		t.Fatalf("minfo says no geometry:\n%s", out)
	}
	a, _ := strconv.ParseInt(sec[1], 10, 64)
	b, _ := strconv.ParseInt(spc[1], 10, 64)
	return a * b
}

var images = []struct {
	name string
	kib  int
	args []string
	cs   int64 // cluster size the arguments ask for (checked against minfo)
	opts treeOpts
}{
	{"FAT12 2K clusters", 8000, []string{"-F", "12", "-s", "4"}, 2048, treeOpts{deep: 40, big: 3<<20 + 7}},
	{"FAT12 4K sectors", 12000, []string{"-F", "12", "-S", "4096", "-s", "1"}, 4096, treeOpts{deep: 8, big: 1 << 20}},
	{"FAT16 512-byte clusters", 30000, []string{"-F", "16", "-s", "1"}, 512, treeOpts{many: 3000, deep: 40, big: 3<<20 + 7}},
	{"FAT16 4K sectors", 20000, []string{"-F", "16", "-S", "4096", "-s", "1"}, 4096, treeOpts{deep: 12, big: 5 << 20}},
	{"FAT32 512-byte clusters", 40000, []string{"-F", "32", "-s", "1"}, 512, treeOpts{many: 3000, deep: 40, big: 3<<20 + 7}},
	{"FAT32 4K clusters", 270000, []string{"-F", "32", "-s", "8"}, 4096, treeOpts{deep: 4, big: 3<<20 + 7}},
	{"FAT32 4K sectors", 270000, []string{"-F", "32", "-S", "4096", "-s", "1"}, 4096, treeOpts{many: 500, deep: 40, big: 3<<20 + 7}},
}

// TestTrees reads images mkfs.fat and mcopy made of generated trees and
// compares everything with the tree, mtools and Linux's rules.
func TestTrees(t *testing.T) {
	need(t, "mkfs.fat", "mcopy", "mattrib", "mdir", "mtype", "minfo", "fsck.fat")
	for _, im := range images {
		t.Run(im.name, func(t *testing.T) {
			tree := genTree(t, im.cs, im.opts)
			img := makeImage(t, tree, im.kib, im.args...)
			if cs := clusterSize(t, img); cs != im.cs {
				t.Fatalf("minfo: %d-byte clusters, want %d", cs, im.cs)
			}
			f := openImage(t, img)
			if f.Label() != "GUEST46" || f.Type() != "vfat" {
				t.Errorf("label %q type %q, want GUEST46 vfat", f.Label(), f.Type())
			}
			compareTree(t, f, tree, im.cs)
			compareMtools(t, f, img)
			if err := fstest.TestFS(f, "size1.bin", "lower.txt", "漢字テスト.txt", "sub/inner/file.dat", "empty dir"); err != nil {
				t.Error(err)
			}
		})
	}
}

// compareTree checks every file and directory of tree against f.
func compareTree(t *testing.T, f *FS, tree string, cs int64) {
	t.Helper()
	err := filepath.WalkDir(tree, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(tree, p)
		rel = filepath.ToSlash(rel)
		src, err := d.Info()
		if err != nil {
			return err
		}
		info, err := f.Stat(rel)
		if err != nil {
			t.Errorf("%s: %v", rel, err)
			return nil
		}
		st := info.Sys().(guestfs.Stat)
		if info.Name() != filepath.Base(p) && rel != "." {
			t.Errorf("%s: name %q", rel, info.Name())
		}
		// mtime: FAT keeps even seconds, rounded down.
		if rel != "." {
			if lag := src.ModTime().Sub(info.ModTime()); lag < 0 || lag >= 2*time.Second {
				t.Errorf("%s: mtime %v, the tree's %v", rel, info.ModTime(), src.ModTime())
			}
			if !st.Ctime.Equal(st.Mtime) {
				t.Errorf("%s: ctime %v, not mtime %v", rel, st.Ctime, st.Mtime)
			}
		}
		if st.Uid != 0 || st.Gid != 0 {
			t.Errorf("%s: owner %d:%d", rel, st.Uid, st.Gid)
		}
		if d.IsDir() {
			want := []string{}
			subdirs := uint32(0)
			ents, _ := os.ReadDir(p)
			for _, e := range ents {
				want = append(want, e.Name())
				if e.IsDir() {
					subdirs++
				}
			}
			got := []string{}
			ours, err := f.ReadDir(rel)
			if err != nil {
				t.Errorf("%s: %v", rel, err)
			}
			for _, e := range ours {
				got = append(got, e.Name())
			}
			if !slices.Equal(got, want) {
				t.Errorf("%s: lists %q, the tree %q", rel, got, want)
			}
			if info.Mode() != fs.ModeDir|0o755 || st.Nlink != 2+subdirs {
				t.Errorf("%s: mode %v nlink %d, want drwxr-xr-x and %d", rel, info.Mode(), st.Nlink, 2+subdirs)
			}
			if st.Size == 0 || st.Size%cs != 0 && rel != "." || st.Blocks*512 != (st.Size+cs-1)/cs*cs {
				t.Errorf("%s: size %d blocks %d with %d-byte clusters", rel, st.Size, st.Blocks, cs)
			}
			return nil
		}
		want, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		got, err := fs.ReadFile(f, rel)
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s: %d bytes (%v), the tree's %d differ", rel, len(got), err, len(want))
		}
		mode := fs.FileMode(0o755)
		if filepath.Base(p) == "readonly.txt" {
			mode = 0o555
		}
		if info.Mode() != mode || info.Size() != src.Size() || st.Nlink != 1 ||
			st.Blocks*512 != (src.Size()+cs-1)/cs*cs {
			t.Errorf("%s: mode %v size %d nlink %d blocks %d; want %v %d 1 %d", rel, info.Mode(), info.Size(),
				st.Nlink, st.Blocks, mode, src.Size(), (src.Size()+cs-1)/cs*cs/512)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// mtoolsDiffers lists names mtools shows otherwise than Linux: a short
// name with a lower-case flag and a non-ASCII letter ("CAFÉ.TXT", flags
// set: Linux lowers É through codepage 437, mtools only ASCII).
var mtoolsDiffers = map[string]string{"café.txt": "cafÉ.txt", "ñ.txt": "Ñ.txt"}

// compareMtools checks every path against mdir's bare listing, and some
// files' bytes against mtype.
func compareMtools(t *testing.T, f *FS, img string) {
	t.Helper()
	var want []string
	for _, l := range strings.Split(strings.TrimSpace(tool(t, "mdir", "-/", "-b", "-a", "-i", img, "::")), "\n") {
		l = strings.TrimSuffix(strings.TrimPrefix(l, "::/"), "/")
		if strings.HasSuffix(l, "/.") || strings.HasSuffix(l, "/..") {
			continue
		}
		want = append(want, l)
	}
	var got []string
	err := fs.WalkDir(f, ".", func(p string, d fs.DirEntry, err error) error {
		if err == nil && p != "." {
			dir, base := filepath.Split(p)
			if alt, ok := mtoolsDiffers[base]; ok {
				base = alt
			}
			got = append(got, dir+base)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(got)
	slices.Sort(want)
	for _, p := range got {
		if _, ok := slices.BinarySearch(want, p); !ok {
			t.Errorf("%q: mdir does not list it", p)
		}
	}
	for _, p := range want {
		if _, ok := slices.BinarySearch(got, p); !ok {
			t.Errorf("%q: listed by mdir, not by us", p)
		}
	}
	for _, p := range []string{"size1.bin", "sub/inner/file.dat", "漢字テスト.txt"} {
		cmd := exec.Command("mtype", "-i", img, "::/"+p)
		cmd.Env = append(os.Environ(), "LC_ALL=C.UTF-8")
		want, err := cmd.Output()
		if err != nil {
			t.Fatalf("mtype %s: %v", p, err)
		}
		got, err := fs.ReadFile(f, p)
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s: %q (%v), mtype %q", p, got, err, want)
		}
	}
}
