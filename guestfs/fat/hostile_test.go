package fat

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"unicode/utf16"

	"github.com/qcowfs/qcowfs/guestfs"
)

// Damaged and hand-edited images: mkfs.fat and mcopy make a sound one,
// the test changes the bytes a guest could have changed, and the
// expectation is Linux's rule (or, where Linux goes on into an endless
// tree or past the data, this package's documented error). Every read is
// checked to stay inside the image.

// smallImage makes an image of the given FAT type holding a few files and
// directories, and returns its bytes.
func smallImage(t *testing.T, args ...string) []byte {
	need(t, "mkfs.fat", "mcopy", "mdir")
	tree := filepath.Join(t.TempDir(), "tree")
	for name, n := range map[string]int{
		"emojiAB.txt": 3, "loneXY.txt": 4, "orphan long name.txt": 5, "deleted file.txt": 6,
		"slash name.txt": 7, "multi.bin": 5000, "sub/inner/deep.txt": 8, "case/Case.txt": 9,
		"Long file name with spaces.text": 10, "readonly.txt": 11, "ümlaut.txt": 12,
	} {
		p := filepath.Join(tree, name)
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, bytes.Repeat([]byte{byte(n)}, n), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	kib := 4096
	if slices.Contains(args, "32") {
		kib = 34000 // mtools wants a FAT32 of 65525 clusters or more
	}
	img := makeImage(t, tree, kib, args...)
	b, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// boundedReader fails the test on any read outside its bytes.
type boundedReader struct {
	t *testing.T
	b []byte
}

func (r boundedReader) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 || off+int64(len(p)) > int64(len(r.b)) {
		r.t.Errorf("read of %d bytes at %d, outside the %d-byte image", len(p), off, len(r.b))
		return 0, fmt.Errorf("out of range")
	}
	return copy(p, r.b[off:]), nil
}

func openBytes(t *testing.T, b []byte) (*FS, error) {
	return Open(boundedReader{t, b}, int64(len(b)))
}

// entryAt finds the short entry named short (11 bytes, as stored).
func entryAt(t *testing.T, b []byte, short string) int {
	i := bytes.Index(b, []byte(short))
	if i < 0 || i%direntLen != 0 {
		t.Fatalf("no entry %q", short)
	}
	return i
}

// setLFNChar sets UTF-16 unit k of the long name whose short entry is at
// off (one slot: names of up to 13 units).
func setLFNChar(b []byte, off, k int, u uint16) {
	slot := b[off-direntLen:]
	pos := []int{1, 3, 5, 7, 9, 14, 16, 18, 20, 22, 24, 28, 30}[k]
	binary.LittleEndian.PutUint16(slot[pos:], u)
}

func TestNames(t *testing.T) {
	b := smallImage(t, "-F", "16", "-s", "1")
	// A surrogate pair where mcopy wrote "AB" (mtools 4.0.32 cuts a
	// character past U+FFFF to 16 bits, so it cannot make one).
	pair := utf16.Encode([]rune("😀"))
	e := entryAt(t, b, "EMOJIAB TXT")
	setLFNChar(b, e, 5, pair[0])
	setLFNChar(b, e, 6, pair[1])
	// A lone high surrogate: Linux's utf16s_to_utf8s drops it.
	setLFNChar(b, entryAt(t, b, "LONEXY  TXT"), 4, 0xD800)
	// A long name whose checksum no longer matches: the short name shows.
	o := entryAt(t, b, "ORPHAN~1TXT")
	for s := o - direntLen; b[s+11] == attrLongName; s -= direntLen {
		b[s+13]++
	}
	// A deleted file, short entry and slots.
	d := entryAt(t, b, "DELETE~1TXT")
	for s := d; s == d || b[s+11] == attrLongName; s -= direntLen {
		b[s] = deletedFlag
	}
	f, err := openBytes(t, b)
	if err != nil {
		t.Fatal(err)
	}
	ents, err := f.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range ents {
		got = append(got, e.Name())
	}
	want := "Long file name with spaces.text ORPHAN~1.TXT case emoji😀.txt loneY.txt multi.bin readonly.txt slash name.txt sub ümlaut.txt"
	if strings.Join(got, " ") != want {
		t.Errorf("root lists %q, want %q", got, want)
	}
	// mtools agrees on what it can say: the orphaned long name and the
	// deleted file.
	img := filepath.Join(t.TempDir(), "edited.img")
	os.WriteFile(img, b, 0o644)
	out := tool(t, "mdir", "-b", "-i", img, "::")
	if !strings.Contains(out, "::/ORPHAN~1.TXT") || strings.Contains(out, "deleted") {
		t.Errorf("mdir disagrees:\n%s", out)
	}

	// Lookups: ASCII case aside, by long or short name, stored name.
	for name, stored := range map[string]string{
		"CASE/case.TXT": "Case.txt", "LONGFI~1.TEX": "Long file name with spaces.text",
		"long FILE name with spaces.TEXT": "Long file name with spaces.text", "emoji😀.TXT": "emoji😀.txt",
	} {
		info, err := f.Stat(name)
		if err != nil || info.Name() != stored {
			t.Errorf("Stat(%q): %v, %v; want %q", name, info, err, stored)
		}
	}
	if _, err := f.Stat("üMLAUT.TXT"); err != nil {
		t.Errorf("Stat of the name in other ASCII case: %v", err)
	}
	if _, err := f.Stat("ÜMLAUT.txt"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Stat of the name in other case: %v, want not found (Linux folds ASCII only)", err)
	}
	// Inode numbers: the same from a listing, a lookup and a stat.
	des, err := f.ReadDirIno(f.RootIno())
	if err != nil {
		t.Fatal(err)
	}
	for _, de := range des {
		st, err := f.Lookup(f.RootIno(), de.Name)
		if err != nil || st.Ino != de.Ino {
			t.Errorf("%s: lookup %d %v, listing %d", de.Name, st.Ino, err, de.Ino)
		}
		st2, err := f.StatIno(de.Ino)
		if err != nil || st2 != st {
			t.Errorf("%s: StatIno %+v %v, Lookup %+v", de.Name, st2, err, st)
		}
	}
}

// mutate is one damage to an image and the error it must give.
type mutate struct {
	name  string
	args  []string // mkfs.fat's
	edit  func(t *testing.T, b []byte) []byte
	open  bool   // Open itself fails
	path  string // else reading this path (walking a directory) fails
	field string // the FormatError's field
}

func le16(b []byte, off int, v uint16) { binary.LittleEndian.PutUint16(b[off:], v) }
func le32(b []byte, off int, v uint32) { binary.LittleEndian.PutUint32(b[off:], v) }

// fatSet sets cluster c's FAT16 entry in every FAT.
func fatSet(b []byte, c uint32, v uint16) {
	ss := int(binary.LittleEndian.Uint16(b[11:]))
	fat := int(binary.LittleEndian.Uint16(b[14:])) * ss
	n := int(binary.LittleEndian.Uint16(b[22:])) * ss
	for k := 0; k < int(b[16]); k++ {
		le16(b, fat+k*n+int(c)*2, v)
	}
}

func startOf(b []byte, e int) uint32 {
	return uint32(binary.LittleEndian.Uint16(b[e+26:])) | uint32(binary.LittleEndian.Uint16(b[e+20:]))<<16
}

var fat16 = []string{"-F", "16", "-s", "1"}
var fat32 = []string{"-F", "32", "-s", "1"}

func boot(off int, v uint32, wide bool) func(*testing.T, []byte) []byte {
	return func(_ *testing.T, b []byte) []byte {
		if wide {
			le32(b, off, v)
		} else if off == 13 || off == 16 || off == 21 {
			b[off] = byte(v)
		} else {
			le16(b, off, uint16(v))
		}
		return b
	}
}

var mutations = []mutate{
	{name: "sector size 0", args: fat16, edit: boot(11, 0, false), open: true, field: "BPB_BytsPerSec"},
	{name: "sector size 1000", args: fat16, edit: boot(11, 1000, false), open: true, field: "BPB_BytsPerSec"},
	{name: "sector size 8192", args: fat16, edit: boot(11, 8192, false), open: true, field: "BPB_BytsPerSec"},
	{name: "sectors per cluster 0", args: fat16, edit: boot(13, 0, false), open: true, field: "BPB_SecPerClus"},
	{name: "sectors per cluster 3", args: fat16, edit: boot(13, 3, false), open: true, field: "BPB_SecPerClus"},
	{name: "no reserved sectors", args: fat16, edit: boot(14, 0, false), open: true, field: "BPB_RsvdSecCnt"},
	{name: "no FAT", args: fat16, edit: boot(16, 0, false), open: true, field: "BPB_NumFATs"},
	{name: "255 FATs", args: fat16, edit: boot(16, 255, false), open: true, field: "BPB_TotSec16"},
	{name: "media 0x12", args: fat16, edit: boot(21, 0x12, false), open: true, field: "BPB_Media"},
	{name: "root entries 3", args: fat16, edit: boot(17, 3, false), open: true, field: "BPB_RootEntCnt"},
	{name: "total sectors past the end", args: fat16, edit: boot(19, 0xFFFF, false), open: true, field: "BPB_TotSec16"},
	{name: "truncated image", args: fat16, edit: func(_ *testing.T, b []byte) []byte { return b[:len(b)/2] }, open: true, field: "BPB_TotSec16"},
	{name: "no FAT sectors", args: fat32, edit: boot(36, 0, true), open: true, field: "BPB_FATSz32"},
	{name: "root cluster 0", args: fat32, edit: boot(44, 0, true), open: true, field: "BPB_RootClus"},
	{name: "root cluster past the end", args: fat32, edit: boot(44, 0x0FFFFFF0, true), open: true, field: "BPB_RootClus"},
	{name: "FAT32 root chain loops", args: fat32, edit: func(t *testing.T, b []byte) []byte {
		root := binary.LittleEndian.Uint32(b[44:])
		ss := int(binary.LittleEndian.Uint16(b[11:]))
		fat := int(binary.LittleEndian.Uint16(b[14:])) * ss
		le32(b, fat+int(root)*4, root)
		return b
	}, open: true, field: "cluster chain from"},
	{name: "file chain hits a free entry", args: fat16, edit: func(t *testing.T, b []byte) []byte {
		fatSet(b, startOf(b, entryAt(t, b, "MULTI   BIN")), 0)
		return b
	}, path: "multi.bin", field: "FAT entry of cluster"},
	{name: "file chain leaves the data area", args: fat16, edit: func(t *testing.T, b []byte) []byte {
		fatSet(b, startOf(b, entryAt(t, b, "MULTI   BIN")), 0xFFF0)
		return b
	}, path: "multi.bin", field: "FAT entry of cluster"},
	{name: "file size past its chain", args: fat16, edit: func(t *testing.T, b []byte) []byte {
		le32(b, entryAt(t, b, "MULTI   BIN")+28, 1<<30)
		return b
	}, path: "multi.bin", field: "DIR_FileSize"},
	{name: "file starts at cluster 1", args: fat16, edit: func(t *testing.T, b []byte) []byte {
		le16(b, entryAt(t, b, "MULTI   BIN")+26, 1)
		return b
	}, path: "multi.bin", field: "DIR_FstClus"},
	{name: "directory chain loops", args: fat16, edit: func(t *testing.T, b []byte) []byte {
		c := startOf(b, entryAt(t, b, "SUB        "))
		fatSet(b, c, uint16(c))
		return b
	}, path: "sub", field: "cluster chain from"},
	{name: "subdirectory is its ancestor", args: fat16, edit: func(t *testing.T, b []byte) []byte {
		sub := startOf(b, entryAt(t, b, "SUB        "))
		le16(b, entryAt(t, b, "INNER      ")+26, uint16(sub))
		return b
	}, path: "sub/inner", field: "'..' entry's DIR_FstClus"},
	{name: "subdirectory is the FAT32 root", args: fat32, edit: func(t *testing.T, b []byte) []byte {
		e := entryAt(t, b, "INNER      ")
		le16(b, e+26, uint16(binary.LittleEndian.Uint32(b[44:])))
		le16(b, e+20, 0)
		return b
	}, path: "sub/inner", field: "DIR_FstClus"},
	{name: "a '/' in a long name", args: fat16, edit: func(t *testing.T, b []byte) []byte {
		setLFNChar(b, entryAt(t, b, "SLASHN~1TXT"), 5, '/')
		return b
	}, path: ".", field: "name"},
}

func TestHostile(t *testing.T) {
	clean := map[string][]byte{}
	for _, m := range mutations {
		t.Run(m.name, func(t *testing.T) {
			key := strings.Join(m.args, " ")
			if clean[key] == nil {
				clean[key] = smallImage(t, m.args...)
			}
			b := m.edit(t, bytes.Clone(clean[key]))
			f, err := openBytes(t, b)
			if !m.open {
				if err != nil {
					t.Fatalf("Open: %v", err)
				}
				// The damage shows where it is, and nowhere else:
				// every other file still reads.
				err = fs.WalkDir(f, ".", func(p string, d fs.DirEntry, err error) error {
					if err != nil || d.IsDir() {
						return err
					}
					_, err = fs.ReadFile(f, p)
					return err
				})
				if err == nil {
					t.Fatal("walking the tree and reading every file: no error")
				}
				var pe *fs.PathError
				if !errors.As(err, &pe) || pe.Path != m.path {
					t.Errorf("error at %v, want at %q", err, m.path)
				}
			}
			var fe *guestfs.FormatError
			if !errors.As(err, &fe) || !errors.Is(err, guestfs.ErrCorrupt) || fe.Field != m.field {
				t.Fatalf("error %v, want a FormatError of field %q", err, m.field)
			}
			if !m.open && fe.Inode == 0 {
				t.Errorf("%v: names no inode", err)
			}
			t.Log(err)
		})
	}
}
