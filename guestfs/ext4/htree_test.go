package ext4

import (
	"fmt"
	"strings"
	"testing"
)

// TestHtreeLookup looks up every name of the 10,000-entry folder through
// its hash index, one level deep (4 KiB blocks) and two (1 KiB blocks),
// as the kernel indexed it (debugfs says how deep), and names that are
// not there: every lookup must use the index, not fall back to a scan.
func TestHtreeLookup(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: makes images of 10,000-entry folders")
	}
	requireTools(t, "debugfs")
	for _, c := range []struct {
		img    imageCase
		levels string
	}{
		{imageCase{tree: timesTree, mkfs: []string{"-b", "4096"}, kernel: true}, "Indirect levels: 0"},
		{imageCase{tree: timesTree1K, mkfs: []string{"-t", "ext2", "-b", "1024"}, kernel: true}, "Indirect levels: 1"},
	} {
		t.Run(strings.Join(c.img.mkfs, ""), func(t *testing.T) {
			img := c.img.madeImage(t)
			if out := command(t, "debugfs", "-R", "htree bigdir", img); !strings.Contains(out, c.levels) {
				t.Fatalf("debugfs htree bigdir does not say %q:\n%.500s", c.levels, out)
			}
			fsys := openImage(t, img)
			root, _ := fsys.readInode(RootIno)
			dir, err := fsys.lookup(root, "bigdir")
			if err != nil {
				t.Fatal(err)
			}
			if !fsys.isDx(dir) {
				t.Fatal("bigdir is not hash-indexed")
			}
			list, err := fsys.readDir(dir)
			if err != nil || len(list) != 10001 {
				t.Fatalf("readDir: %d entries, %v", len(list), err)
			}
			for _, e := range list {
				ino, found, usable, err := fsys.lookupDx(dir, e.Name)
				if err != nil || !usable || !found || uint64(ino) != e.Ino {
					t.Fatalf("lookupDx(%q) = %d, found %v, usable %v, %v; the listing says inode %d", e.Name, ino, found, usable, err, e.Ino)
				}
			}
			for i := range 1000 {
				name := fmt.Sprintf("absent-%d", i)
				if ino, found, usable, err := fsys.lookupDx(dir, name); err != nil || !usable || found {
					t.Fatalf("lookupDx(%q) = %d, found %v, usable %v, %v; want not found, by the index", name, ino, found, usable, err)
				}
			}
		})
	}
}
