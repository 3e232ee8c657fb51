package main

import (
	"archive/tar"
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// Realistic data: the bytes of real files from /usr, so that compression
// ratios and the mix of small and large files are what real disks have,
// not what random bytes or patterns have.

// errFull stops a walk once enough bytes were written.
var errFull = errors.New("full")

// limitWriter passes the first left bytes on, then fails with errFull.
type limitWriter struct {
	w    io.Writer
	left int64
}

func (l *limitWriter) Write(p []byte) (int, error) {
	if l.left <= 0 {
		return 0, errFull
	}
	short := int64(len(p)) > l.left
	if short {
		p = p[:l.left]
	}
	n, err := l.w.Write(p)
	l.left -= int64(n)
	if err == nil && short {
		err = errFull
	}
	return n, err
}

// writeUsrTar writes exactly size bytes of a tar archive of /usr (in
// lexical order; walked again if /usr holds less) to dst: real file
// contents in every cluster.
func writeUsrTar(dst string, size int64) error {
	f, err := os.Create(dst)
	if err != nil {
		return err
	}
	defer f.Close()
	bw := bufio.NewWriterSize(f, 4<<20)
	lw := &limitWriter{w: bw, left: size}
	for pass := 0; lw.left > 0; pass++ {
		if pass > 100 {
			return fmt.Errorf("/usr holds too little to fill %d bytes", size)
		}
		tw := tar.NewWriter(lw)
		err := filepath.WalkDir("/usr", func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return nil // unreadable: skip
			}
			return tarOne(tw, p, d, pass)
		})
		if errors.Is(err, errFull) {
			break
		}
		if err != nil {
			return err
		}
		if err := tw.Flush(); errors.Is(err, errFull) {
			break
		} else if err != nil {
			return err
		}
	}
	if err := bw.Flush(); err != nil {
		return err
	}
	if err := f.Truncate(size); err != nil { // in case the last pass fell short
		return err
	}
	return f.Close()
}

// tarOne adds one file, folder or symlink to tw; other kinds are skipped.
func tarOne(tw *tar.Writer, p string, d fs.DirEntry, pass int) error {
	info, err := d.Info()
	if err != nil {
		return nil
	}
	link := ""
	switch {
	case info.Mode().IsRegular(), info.IsDir():
	case info.Mode()&fs.ModeSymlink != 0:
		if link, err = os.Readlink(p); err != nil {
			return nil
		}
	default:
		return nil
	}
	hdr, err := tar.FileInfoHeader(info, link)
	if err != nil {
		return nil
	}
	hdr.Name = fmt.Sprintf("pass%d%s", pass, p)
	if !info.Mode().IsRegular() {
		return tw.WriteHeader(hdr)
	}
	src, err := os.Open(p)
	if err != nil {
		return nil
	}
	defer src.Close()
	if err := tw.WriteHeader(hdr); err != nil {
		return err
	}
	// The file may shrink while read: pad to the size in the header.
	n, err := io.CopyN(tw, src, hdr.Size)
	if errors.Is(err, errFull) {
		return err
	}
	if n < hdr.Size {
		if _, err := io.CopyN(tw, zeroReader{}, hdr.Size-n); err != nil {
			return err
		}
	}
	return nil
}

type zeroReader struct{}

func (zeroReader) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// The guest disk: a GPT disk whose one partition, at 1 MiB, holds an ext4
// file system full of files copied from /usr/share and /usr/lib.
const (
	guestPartStart = 1 << 20
	guestShareMiB  = 256 // taken from /usr/share
	guestLibMiB    = 128 // taken from /usr/lib
)

// makeGuestDisk writes the raw guest disk to dst.
func (b *bench) makeGuestDisk(dst string) error {
	stage := dst + ".tree"
	os.RemoveAll(stage)
	defer os.RemoveAll(stage)
	var fsBytes int64
	for _, src := range []struct {
		dir    string
		budget int64
	}{{"/usr/share", guestShareMiB * mib}, {"/usr/lib", guestLibMiB * mib}} {
		n, err := copyTree(src.dir, filepath.Join(stage, filepath.Base(src.dir)), src.budget)
		if err != nil {
			return err
		}
		fsBytes += n
	}

	part := dst + ".part"
	defer os.Remove(part)
	// Room for the files, their metadata and the journal; more if
	// mkfs finds it too small.
	partSize := roundUp(fsBytes*5/4+96*mib, mib)
	for try := 0; ; try++ {
		os.Remove(part)
		_, err := b.must(&cmd{name: "mkfs.ext4", args: []string{"-q", "-F", "-d", stage, "-L", "guest", part, strconv.FormatInt(partSize/kib, 10) + "k"}, timeout: 10 * time.Minute})
		if err == nil {
			break
		}
		if try == 2 {
			return err
		}
		partSize = roundUp(partSize*3/2, mib)
	}

	f, err := os.Create(dst)
	if err != nil {
		return err
	}
	err = f.Truncate(guestPartStart + partSize + mib) // the backup GPT goes in the last MiB
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	sfdisk := &cmd{name: "sfdisk", args: []string{"-q", dst},
		stdin: strings.NewReader(fmt.Sprintf("label: gpt\nstart=%dKiB, size=%dKiB, type=linux\n", guestPartStart/kib, partSize/kib))}
	if _, err := b.must(sfdisk); err != nil {
		return err
	}
	start, size, err := b.guestPartition(dst)
	if err != nil {
		return err
	}
	if start != guestPartStart || size != partSize {
		return fmt.Errorf("sfdisk put the partition at %d+%d, want %d+%d", start, size, guestPartStart, partSize)
	}
	_, err = b.must(command("dd", "if="+part, "of="+dst, "bs=1M", "oflag=seek_bytes",
		"seek="+strconv.Itoa(guestPartStart), "conv=notrunc,sparse", "status=none"))
	return err
}

// guestPartition returns the byte range of the first partition of a disk,
// as sfdisk reads its partition table.
func (b *bench) guestPartition(disk string) (start, size int64, err error) {
	out, err := b.must(command("sfdisk", "--json", disk))
	if err != nil {
		return 0, 0, err
	}
	var table struct {
		PartitionTable struct {
			SectorSize int64 `json:"sectorsize"`
			Partitions []struct {
				Start int64 `json:"start"`
				Size  int64 `json:"size"`
			} `json:"partitions"`
		} `json:"partitiontable"`
	}
	if err := json.Unmarshal([]byte(out), &table); err != nil {
		return 0, 0, fmt.Errorf("sfdisk --json %s: %w", disk, err)
	}
	pt := table.PartitionTable
	if len(pt.Partitions) != 1 || pt.SectorSize == 0 {
		return 0, 0, fmt.Errorf("%s: want one partition, sfdisk says %+v", disk, pt)
	}
	return pt.Partitions[0].Start * pt.SectorSize, pt.Partitions[0].Size * pt.SectorSize, nil
}

// copyTree copies folders, regular files and symlinks from src to dst in
// lexical order until budget bytes of file data were copied, and returns
// roughly what they take on ext4 (4 KiB blocks, one block per folder).
func copyTree(src, dst string, budget int64) (int64, error) {
	var used, data int64
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		rel, _ := filepath.Rel(src, p)
		to := filepath.Join(dst, rel)
		info, err := d.Info()
		if err != nil {
			return nil
		}
		switch {
		case d.IsDir():
			used += 4 * kib
			return os.MkdirAll(to, 0o755)
		case info.Mode()&fs.ModeSymlink != 0:
			if link, err := os.Readlink(p); err == nil {
				os.Symlink(link, to)
			}
			return nil
		case !info.Mode().IsRegular():
			return nil
		}
		if data+info.Size() > budget {
			if data > budget-mib {
				return filepath.SkipAll
			}
			return nil // too big for what is left; smaller ones may fit
		}
		n, err := copyFile(p, to, info.Mode().Perm())
		if err != nil {
			return nil // unreadable: skip
		}
		data += n
		used += roundUp(n, 4*kib)
		return nil
	})
	return used, err
}

func copyFile(src, dst string, perm fs.FileMode) (int64, error) {
	in, err := os.Open(src)
	if err != nil {
		return 0, err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, perm|0o200)
	if err != nil {
		return 0, err
	}
	n, err := io.Copy(out, in)
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(dst)
	}
	return n, err
}

func roundUp(n, to int64) int64 { return (n + to - 1) / to * to }
