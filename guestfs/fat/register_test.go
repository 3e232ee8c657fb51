package fat_test

import (
	"bytes"
	"io/fs"
	"testing"

	"github.com/qcowfs/qcowfs/guestfs"
)

// TestGuestfsOpen: guestfs.Open names a FAT partition by its signature and
// hands it to this package, for FAT12, FAT16 and FAT32.
func TestGuestfsOpen(t *testing.T) {
	for _, name := range []string{"fat12", "fat16", "fat32"} {
		img := gunzip("testdata/" + name + ".img.gz")
		fsys, err := guestfs.Open(bytes.NewReader(img), int64(len(img)))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if fsys.Type() != "vfat" {
			t.Errorf("%s: type %q", name, fsys.Type())
		}
		if _, err := fs.ReadDir(fsys, "."); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
}
