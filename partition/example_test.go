package partition_test

import (
	"fmt"
	"io"
	"log"
	"os"

	"github.com/qcowfs/qcowfs/partition"
)

// Read a raw disk image and print its partitions, each readable as a
// section of the disk.
func ExampleRead() {
	f, err := os.Open("disk.raw")
	if err != nil {
		log.Fatal(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		log.Fatal(err)
	}
	t, err := partition.Read(f, fi.Size(), 0)
	if err != nil {
		log.Fatal(err) // errors.Is(err, partition.ErrNoTable): a bare file system
	}
	for _, w := range t.Warnings {
		log.Print(w)
	}
	for _, p := range t.Partitions {
		if p.Extended {
			continue // a container of logical partitions, not a volume
		}
		var part io.ReaderAt = io.NewSectionReader(f, p.Start, p.Size)
		_ = part
		fmt.Printf("p%d: %d bytes at %d, %s %q\n", p.Number, p.Size, p.Start, p.TypeName, p.Name)
	}
}
