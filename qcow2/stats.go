package qcow2

import "syscall"

// Stats counts what an image's reads and block status cost, over every
// layer of its chain.
type Stats struct {
	Inflates        int64 `json:"inflates"`         // compressed clusters inflated
	CompressedReads int64 `json:"compressed-reads"` // reads of compressed data (one per inflate)
	HostReads       int64 `json:"host-reads"`       // reads those turned into on the host files
	HoleProbes      int64 `json:"hole-probes"`      // FIEMAP ioctls and lseeks to find host holes
}

// Stats returns the image's counters.
func (img *Image) Stats() Stats {
	var s Stats
	for l := img.top; l != nil; l = l.backing {
		if m := l.host.Load(); m != nil {
			s.HoleProbes += m.Stats().HostCalls()
		}
		s.Inflates += l.comp.inflates.Load()
		if ra := l.comp.ra.Load(); ra != nil {
			rs := ra.Stats()
			s.CompressedReads += rs.Calls
			s.HostReads += rs.Reads
		}
	}
	return s
}

// AllocatedBytes returns the space the host file systems allocate for all
// files of the chain (images, data files, raw backing files): a cheap upper
// estimate of DataBytes for images that are not compressed.
func (img *Image) AllocatedBytes() int64 {
	var total int64
	for l := img.top; l != nil; l = l.backing {
		total += allocatedBytes(l.file)
		if l.dataFile != nil {
			total += allocatedBytes(l.dataFile)
		}
	}
	return total
}

// allocatedBytes is the space the host file system allocates for f
// (st_blocks); for a file without a descriptor, its size.
func allocatedBytes(f HostFile) int64 {
	if lf := fileOf(f); lf != nil {
		var st syscall.Stat_t
		if syscall.Fstat(int(lf.Fd()), &st) == nil {
			return st.Blocks * 512
		}
		return 0
	}
	size, _ := f.Size()
	return size
}

// MaxFiles returns the most file descriptors the image may hold: one for
// each file of its chain (images, data files, raw backing files), and one
// more for each, opened on first use, to probe its holes.
func (img *Image) MaxFiles() int {
	n := 0
	for l := img.top; l != nil; l = l.backing {
		n += 2
		if l.dataFile != nil {
			n += 2
		}
	}
	return n
}
