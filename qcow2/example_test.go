package qcow2_test

import (
	"fmt"
	"log"

	"github.com/qcowfs/qcowfs/qcow2"
)

// testdata/example.qcow2 is a 1 MiB image with 4 KiB clusters that
// qemu-io wrote: 4 KiB of 'a' at 0, 8 KiB of 'b' at 64 KiB, and a zero
// cluster at 128 KiB.

func ExampleOpen() {
	img, err := qcow2.Open("testdata/example.qcow2", qcow2.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer img.Close()

	buf := make([]byte, 4)
	if _, err := img.ReadAt(buf, 65536); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%d bytes, %d-byte clusters; at 64 KiB: %q\n", img.Size(), img.Header().ClusterSize(), buf)
	// Output: 1048576 bytes, 4096-byte clusters; at 64 KiB: "bbbb"
}

func ExampleImage_Extent() {
	img, err := qcow2.Open("testdata/example.qcow2", qcow2.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer img.Close()

	// Walk the disk extent by extent, as qemu-img map does.
	for off := int64(0); off < img.Size(); {
		e, err := img.Extent(off, img.Size()-off)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("%7d +%-7d %s\n", e.Start, e.Length, e.Status)
		off += e.Length
	}
	// Output:
	//       0 +4096    data|allocated
	//    4096 +61440   zero
	//   65536 +8192    data|allocated
	//   73728 +57344   zero
	//  131072 +4096    zero|allocated
	//  135168 +913408  zero
}
