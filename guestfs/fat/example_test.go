package fat_test

import (
	"bytes"
	"compress/gzip"
	"fmt"
	"io"
	"io/fs"
	"log"
	"os"

	"github.com/qcowfs/qcowfs/guestfs"
	"github.com/qcowfs/qcowfs/guestfs/fat"
)

// A FAT file system read as an io/fs.FS. The image (testdata/fat12.img.gz)
// is what mkfs.fat and mcopy -s -m made of a folder with hello.txt and
// Docs/Read me first.md; in qcowfs the ReaderAt is a partition of a qcow2
// image (an io.SectionReader over a qcow2.Image).
func ExampleOpen() {
	img := gunzip("testdata/fat12.img.gz")
	fsys, err := fat.Open(bytes.NewReader(img), int64(len(img)))
	if err != nil {
		log.Fatal(err)
	}
	hello, err := fs.ReadFile(fsys, "hello.txt")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s %s: %q\n", fsys.Type(), fsys.Label(), hello)
	fs.WalkDir(fsys, "Docs", func(p string, d fs.DirEntry, err error) error {
		info, _ := d.Info()
		st := info.Sys().(guestfs.Stat)
		fmt.Println(p, info.Mode(), info.Size(), info.ModTime().Format("2006-01-02 15:04:05"), "nlink", st.Nlink)
		return err
	})
	// Lookups ignore the case of ASCII letters, as Linux's vfat does.
	info, _ := fs.Stat(fsys, "DOCS/READ ME FIRST.MD")
	fmt.Println(info.Name())
	// Output:
	// vfat EXAMPLE: "Hello from a FAT guest.\n"
	// Docs drwxr-xr-x 2048 2024-05-06 07:08:10 nlink 2
	// Docs/Read me first.md -rwxr-xr-x 13 2024-05-06 07:08:10 nlink 1
	// Read me first.md
}

func gunzip(name string) []byte {
	f, err := os.Open(name)
	if err != nil {
		log.Fatal(err)
	}
	defer f.Close()
	z, err := gzip.NewReader(f)
	if err != nil {
		log.Fatal(err)
	}
	b, err := io.ReadAll(z)
	if err != nil {
		log.Fatal(err)
	}
	return b
}
