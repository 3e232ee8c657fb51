package guestfs_test

import (
	"fmt"
	"io"
	"io/fs"
	"log"

	"github.com/qcowfs/qcowfs/guestfs"
	_ "github.com/qcowfs/qcowfs/guestfs/ext4" // registers ext2, ext3, ext4
	"github.com/qcowfs/qcowfs/partition"
	"github.com/qcowfs/qcowfs/qcow2"
)

// testdata/guest.qcow2 is a 4 MiB GPT disk whose partition 1 holds an
// ext4 file system labelled "guestroot", made with:
//
//	truncate -s 4M disk.raw
//	echo 'label: gpt
//	start=2048, size=4096, type=linux, name="root"' | sfdisk disk.raw
//	truncate -s 2M part.img
//	mkfs.ext4 -b 1024 -N 32 -O ^has_journal -L guestroot -d tree part.img
//	dd if=part.img of=disk.raw bs=1M seek=1 conv=notrunc,sparse
//	qemu-img convert -c -O qcow2 -o cluster_size=4096 disk.raw guest.qcow2
//
// where tree holds etc/hostname ("guest") and hello.txt.

// Read a file of a guest's file system from a qcow2 image, without the
// kernel, root or a VM: the image, its partition, the file system.
func ExampleOpen() {
	img, err := qcow2.Open("testdata/guest.qcow2", qcow2.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer img.Close()
	table, err := partition.Read(img, img.Size(), 0)
	if err != nil {
		log.Fatal(err)
	}
	p := table.Partitions[0]
	fsys, err := guestfs.Open(io.NewSectionReader(img, p.Start, p.Size), p.Size)
	if err != nil {
		log.Fatal(err) // an *UnsupportedError names xfs, btrfs, ...
	}
	b, err := fs.ReadFile(fsys, "etc/hostname")
	if err != nil {
		log.Fatal(err)
	}
	info, err := fs.Stat(fsys, "hello.txt")
	if err != nil {
		log.Fatal(err)
	}
	st := info.Sys().(guestfs.Stat)
	fmt.Printf("p%d: %s %q\netc/hostname: %q\nhello.txt: inode %d, %d bytes, mode %v, owner %d:%d\n",
		p.Number, fsys.Type(), fsys.Label(), b, st.Ino, info.Size(), info.Mode(), st.Uid, st.Gid)
	// Output:
	// p1: ext4 "guestroot"
	// etc/hostname: "guest\n"
	// hello.txt: inode 14, 28 bytes, mode -rw-r--r--, owner 0:0
}
