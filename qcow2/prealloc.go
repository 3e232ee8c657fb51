package qcow2

import "syscall"

// Detecting preallocation=metadata, as qemu's
// qcow2_detect_metadata_preallocation does: the image looks preallocated
// when the clusters in use (refcount > 0) number at least max(10/9 of the
// clusters the host file really allocates, those plus two).
//
// qemu asks the refcount of every cluster of the file in turn; a file
// extended sparsely to terabytes has billions of clusters, and so would
// this loop. It goes by refcount block instead: clusters no block covers
// have refcount 0 and cost nothing, and a block is read and summed once
// however many refcount table entries name it. At most
// maxPreallocBlockBytes of distinct blocks are read; beyond that the
// answer is "not preallocated" (block status then reports allocated
// clusters as data, which reads never get wrong), with one warning.

// maxPreallocBlockBytes bounds the refcount blocks the probe reads.
const maxPreallocBlockBytes = 64 << 20

func (l *layer) detectPrealloc() bool {
	var st syscall.Stat_t
	f := fileOf(l.file)
	if f == nil || syscall.Fstat(int(f.Fd()), &st) != nil {
		return false
	}
	cs := l.clusterSize()
	realClusters := st.Blocks * 512 / cs
	threshold := max(realClusters*10/9, realClusters+2)
	end := (l.fsize() + cs - 1) / cs
	table, err := l.refcountTable()
	if err != nil {
		return false
	}
	width := int64(1) << l.hdr.RefcountOrder
	perBlock := cs * 8 / width
	sums := map[[2]int64]int64{} // (block offset, entries summed) -> clusters in use
	var read, count int64
	for ti := int64(0); ti < int64(len(table)) && ti*perBlock < end && count < threshold; ti++ {
		off := int64(table[ti] & reftOffsetMask)
		if off == 0 {
			continue
		}
		limit := min(perBlock, end-ti*perBlock)
		key := [2]int64{off, limit}
		n, ok := sums[key]
		if !ok {
			if read += cs; read > maxPreallocBlockBytes {
				if l.warnf != nil {
					l.warnf("%s: more than %d bytes of refcount blocks; not probing for preallocated metadata (holes of the image file are reported as data)", l.name, maxPreallocBlockBytes)
				}
				return false
			}
			words, _, err := l.refcountBlock(ti)
			if err != nil || words == nil {
				return false
			}
			for i := int64(0); i < limit; i++ {
				if blockRefcount(words, i, width) != 0 {
					n++
				}
			}
			sums[key] = n
		}
		count += n
	}
	return count >= threshold
}
