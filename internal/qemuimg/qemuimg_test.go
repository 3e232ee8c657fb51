package qemuimg_test

// Golden tests with qemu-img as the oracle: for qemu-made images, what
// this package prints from package qcow2's answers is compared with what
// qemu-img info, map and check print for the same file, byte for byte,
// human and JSON. No expected text is written here.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qcowfs/qcowfs/internal/qemuimg"
	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// A run is what one qemu-img command, or its counterpart here, did.
type run = qemu.Output

// failed is our run for an image that did not open: status 1, with a
// reason (which is ours, not qemu's, to word).
func failed(err error) run { return run{Stderr: "qemu-img: " + err.Error() + "\n", Code: 1} }

// same fails t unless us did what q did (qemu.SameOutput: our messages
// start with "qemu-img: " here, as the command's own prefix is not ours).
func same(t *testing.T, what string, q, us run) {
	t.Helper()
	qemu.SameOutput(t, what, "qemu-img: ", q, us)
}

// openRaw opens path as a raw file, as qemu-img given format ("" to
// probe) does, and returns it with its size; or nil if it is qcow2.
func openRaw(t *testing.T, path, format string) (*os.File, int64, error) {
	if format == "" {
		if ok, err := qcow2.IsQcow2(path); err != nil || ok {
			return nil, 0, err
		}
	} else if format != "raw" {
		return nil, 0, nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, 0, err
	}
	t.Cleanup(func() { f.Close() })
	st, err := f.Stat()
	return f, st.Size(), err
}

// info prints what qemu-img info [-f format] [--backing-chain] prints:
// each image opened alone (no backing chain, the corrupt bit allowed),
// encrypted ones described without their key.
func info(t *testing.T, path, format string, chain, json bool) run {
	var infos []any
	for path != "" {
		var next, nextFormat string
		f, size, err := openRaw(t, path, format)
		if err != nil {
			return failed(err)
		}
		if f != nil {
			infos = append(infos, qemuimg.DescribeRaw(path, f, size))
		} else {
			img, err := qcow2.Open(path, qcow2.Options{Cache: qcow2.NewCache(1<<20, 0), AllowCorrupt: true, NoBacking: true})
			var qi qcow2.Info
			var ue *qcow2.UnsupportedError
			switch {
			case errors.As(err, &ue) || errors.Is(err, qcow2.ErrKey):
				if qi, err = qcow2.DescribeEncrypted(path); err != nil {
					return failed(err)
				}
			case err != nil:
				return failed(err)
			default:
				qi = img.Info()
				img.Close()
			}
			infos = append(infos, &qi)
			next, nextFormat = qi.FullBackingFilename, qi.BackingFilenameFormat
		}
		if !chain {
			break
		}
		path, format = next, nextFormat
	}
	var out bytes.Buffer
	switch {
	case json && chain:
		must(t, qemuimg.WriteJSON(&out, infos))
	case json:
		must(t, qemuimg.WriteJSON(&out, infos[0]))
	default:
		for i, v := range infos {
			if i > 0 {
				out.WriteString("\n")
			}
			must(t, qemuimg.WriteInfo(&out, v))
		}
	}
	return run{Stdout: out.String()}
}

// mapOf prints what qemu-img map [-f format] --start-offset=start
// [--max-length=length] prints (length < 0: to the end).
func mapOf(t *testing.T, path, format string, start, length int64, json bool) run {
	o := qemuimg.MapOptions{Start: start, JSON: json, Compressed: qemuimg.MapPrintsCompressed()}
	var walk qemuimg.MapWalk
	f, size, err := openRaw(t, path, format)
	if err != nil {
		return failed(err)
	}
	if f != nil {
		o.End = qemuimg.RawVirtualSize(size)
		walk = func(fn func(qcow2.MapEntry) error) error { return qemuimg.RawMap(f, size, path, fn) }
	} else {
		img, err := qcow2.Open(path, qcow2.Options{Cache: qcow2.NewCache(qcow2.DefaultCacheSize, qcow2.DefaultClusterCacheSize), AllowCorrupt: true})
		if err != nil {
			return failed(err)
		}
		defer img.Close()
		o.End = img.Size()
		walk = func(fn func(qcow2.MapEntry) error) error { return img.Map(context.Background(), fn) }
	}
	if length >= 0 {
		o.End = min(o.End, start+length)
	}
	var out bytes.Buffer
	if err := qemuimg.WriteMap(&out, walk, o); err != nil {
		r := failed(err)
		r.Stdout = out.String()
		return r
	}
	return run{Stdout: out.String()}
}

// checkOf prints what qemu-img check [-f format] prints, and exits as it
// does.
func checkOf(t *testing.T, path, format string, json bool) run {
	if f, _, err := openRaw(t, path, format); err != nil {
		return failed(err)
	} else if f != nil {
		return run{Stderr: "qemu-img: " + qemuimg.ErrNoChecks.Error() + "\n", Code: qemuimg.StatusNoChecks}
	}
	img, err := qcow2.Open(path, qcow2.Options{Cache: qcow2.NewCache(qcow2.DefaultCacheSize, 1<<20), AllowCorrupt: true, LenientTables: true})
	if err != nil {
		return failed(err)
	}
	defer img.Close()
	res, err := img.Check(context.Background(), nil)
	if err != nil {
		t.Fatalf("the check could not complete: %v", err)
	}
	var out, messages bytes.Buffer
	for _, m := range res.Messages {
		fmt.Fprintln(&messages, m)
	}
	if json {
		must(t, qemuimg.WriteJSON(&out, res))
	} else {
		qemuimg.WriteCheck(&out, res)
	}
	return run{Stdout: out.String(), Stderr: messages.String(), Code: qemuimg.CheckStatus(res)}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// images is the test matrix (qemu.StatusMatrix), the images for the fields
// and forms the matrix lacks (qemu.FormImages), and bitmaps (one without
// flags: an empty list; one in use).
func images(t *testing.T, dir string) []qemu.Image {
	images := qemu.StatusMatrix(t, dir)
	images = append(images, qemu.FormImages(t, dir, images[0].Path)...)
	add := func(name, path string) { images = append(images, qemu.Image{Name: name, Path: path}) }
	bitmaps := filepath.Join(dir, "bitmaps.qcow2")
	qemu.Create(t, "qcow2", bitmaps, "16M")
	qemu.Img(t, "bitmap", "--add", bitmaps, "on")
	qemu.Img(t, "bitmap", "--add", "--disable", "-g", "512k", bitmaps, "off")
	qemu.IO(t, bitmaps, "write -P 0x42 0 3M", "write -P 0x43 10M 64k")
	add("bitmaps", bitmaps)
	inUse := filepath.Join(dir, "bitmaps-in-use.qcow2")
	qemu.Create(t, "qcow2", inUse, "16M")
	qemu.Img(t, "bitmap", "--add", inUse, "on")
	qemu.Img(t, "bitmap", "--add", "--disable", inUse, "off")
	qemu.IO(t, inUse, "write -P 0x42 1M 64k")
	_, _, dirOff, _ := qemu.BitmapDirectory(t, inUse)
	qemu.PatchU(t, inUse, dirOff+12, 4, 3) // the first bitmap's flags: in_use, auto
	add("bitmaps-in-use", inUse)
	return images
}

// TestMatchesQemu: for every image of the test matrix and the images
// above (and for check, damaged ones: qemu.Damaged), this package prints
// what qemu-img prints and exits with its status:
//
//   - info, human and JSON, with and without --backing-chain, as probed
//     and with -f raw, by absolute and by relative name. qemu 8.0 and
//     later also describe the image's protocol node ("children"), which
//     qcowfs does not have; with such a qemu, info is not compared.
//   - map, human and JSON, of the whole disk, of a range, of empty ranges
//     (past the end, of no length), as probed and with -f raw. The human
//     form fails at compressed data, as qemu-img's does, after the same
//     header.
//   - check, human and JSON, as probed and with -f raw: the same summary,
//     the same findings on stderr (qemu's words), the same exit status.
func TestMatchesQemu(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	dir := qemu.TempDir(t)
	ims := images(t, dir)
	damaged := filepath.Join(dir, "damaged")
	must(t, os.Mkdir(damaged, 0o755))
	broken := qemu.Damaged(t, damaged)
	withInfo := qemu.Major(t) < 8
	if !withInfo {
		t.Log("qemu 8.0 and later describe the protocol node, which qcowfs has not: info is not compared")
	}
	t.Chdir(dir)
	for _, im := range ims {
		t.Run(im.Name, func(t *testing.T) {
			if withInfo {
				sameInfo(t, im.Path)
			}
			sameMap(t, im.Path)
			sameCheck(t, im.Path)
		})
	}
	for _, im := range broken {
		t.Run("damaged/"+im.Name, func(t *testing.T) { sameCheck(t, im.Path) })
	}
}

// sameInfo compares info on path with qemu-img's.
func sameInfo(t *testing.T, path string) {
	t.Helper()
	for _, name := range []string{path, filepath.Base(path)} {
		for _, json := range []bool{false, true} {
			for _, chain := range []bool{false, true} {
				for _, format := range []string{"", "raw"} {
					args := []string{"info"}
					if format != "" {
						args = append(args, "-f", format)
					}
					if chain {
						args = append(args, "--backing-chain")
					}
					if json {
						args = append(args, "--output=json")
					}
					args = append(args, name)
					same(t, strings.Join(args, " "), qemu.ImgOutput(t, args...), info(t, name, format, chain, json))
				}
			}
		}
	}
}

// sameMap compares map on path with qemu-img's.
func sameMap(t *testing.T, path string) {
	t.Helper()
	for _, json := range []bool{false, true} {
		for _, format := range []string{"", "raw"} {
			for _, r := range []struct{ start, length int64 }{{0, -1}, {1000, 3000000}, {1 << 40, -1}, {4096, 0}} {
				args := []string{"map"}
				if format != "" {
					args = append(args, "-f", format)
				}
				if json {
					args = append(args, "--output=json")
				}
				args = append(args, "--start-offset="+fmt.Sprint(r.start))
				if r.length >= 0 {
					args = append(args, "--max-length="+fmt.Sprint(r.length))
				}
				args = append(args, path)
				qemu.DropCache(path)
				q := qemu.ImgOutput(t, args...)
				same(t, strings.Join(args, " "), q, mapOf(t, path, format, r.start, r.length, json))
			}
		}
	}
}

// sameCheck compares check on path with qemu-img's.
func sameCheck(t *testing.T, path string) {
	t.Helper()
	for _, json := range []bool{false, true} {
		for _, format := range []string{"", "raw"} {
			args := []string{"check"}
			if format != "" {
				args = append(args, "-f", format)
			}
			if json {
				args = append(args, "--output=json")
			}
			args = append(args, path)
			same(t, strings.Join(args, " "), qemu.ImgOutput(t, args...), checkOf(t, path, format, json))
		}
	}
}

// bitmapMapOf prints what qemu-img map [--output=json]
// --start-offset=start [--max-length=length] prints through qemu-nbd -B
// name (length < 0: to the end), with file for the export's name.
func bitmapMapOf(t *testing.T, path, name, file string, start, length int64, json bool) run {
	img, err := qcow2.Open(path, qcow2.Options{})
	if err != nil {
		return failed(err)
	}
	defer img.Close()
	v, err := img.BitmapView(name)
	if err != nil {
		return failed(err)
	}
	defer v.Close()
	o := qemuimg.MapOptions{Start: start, End: v.Size(), JSON: json, Compressed: qemuimg.MapPrintsCompressed()}
	if length >= 0 {
		o.End = min(o.End, start+length)
	}
	var out bytes.Buffer
	walk := func(fn func(qcow2.MapEntry) error) error { return qemuimg.BitmapMap(v, file, fn) }
	must(t, qemuimg.WriteMap(&out, walk, o))
	return run{Stdout: out.String()}
}

// bitmapImages are qemu-made images with persistent bitmaps, and the
// bitmaps to map: granularities of 512 B, 64 KiB and 1 MiB on a disk whose
// size is not a multiple of 1 MiB (the last granule is cut), written,
// discarded and zeroed by qemu-io (which records it), up to the disk's
// last byte; one disabled after writes, one added after them (clean); an
// internal snapshot; every granule dirty.
func bitmapImages(t *testing.T, dir string) map[string][]string {
	out := map[string][]string{}
	p := filepath.Join(dir, "bm.qcow2")
	qemu.Create(t, "qcow2", p, "16896K")
	for _, b := range []struct{ name, gran string }{{"g512", "512"}, {"g64k", "64k"}, {"g1m", "1M"}, {"off", "64k"}} {
		qemu.Img(t, "bitmap", "--add", "-g", b.gran, p, b.name)
	}
	qemu.IO(t, p, "write -P 1 100k 10k", "write -P 2 3M 4k", "discard 5M 1M", "write -z 8M 64k", "write -P 3 16800K 96K")
	qemu.Img(t, "bitmap", "--disable", p, "off")
	qemu.Img(t, "bitmap", "--add", p, "clean")
	out[p] = []string{"g512", "g64k", "g1m", "off", "clean"}
	snap := filepath.Join(dir, "snap.qcow2")
	qemu.Create(t, "qcow2", snap, "8M")
	qemu.Img(t, "bitmap", "--add", snap, "b")
	qemu.IO(t, snap, "write -P 1 0 64k")
	qemu.Img(t, "snapshot", "-c", "s1", snap)
	qemu.IO(t, snap, "write -P 2 7M 1M")
	out[snap] = []string{"b"}
	full := filepath.Join(dir, "full.qcow2")
	qemu.Create(t, "qcow2", full, "4M")
	qemu.Img(t, "bitmap", "--add", "-g", "1M", full, "all")
	qemu.IO(t, full, "write -P 1 0 4M")
	out[full] = []string{"all"}
	return out
}

// TestBitmapMapMatchesQemu: for each bitmap of bitmapImages, BitmapMap
// printed by WriteMap is what qemu-img map prints through qemu-nbd -B NAME
// and x-dirty-bitmap, byte for byte (the export's name, in the human form,
// replaced by the image's), human and JSON, of the whole disk and of
// ranges: one that starts and ends inside granules, past the end, of no
// length. A bitmap in use is refused, as qemu-nbd refuses it.
func TestBitmapMapMatchesQemu(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io", "qemu-nbd")
	dir := qemu.TempDir(t)
	for path, names := range bitmapImages(t, dir) {
		for _, name := range names {
			t.Run(filepath.Base(path)+"/"+name, func(t *testing.T) {
				opts, stop := qemu.ServeBitmap(t, path, name)
				defer stop()
				for _, json := range []bool{false, true} {
					for _, r := range []struct{ start, length int64 }{{0, -1}, {1000, 3000000}, {102500, 16 << 20}, {1 << 40, -1}, {4096, 0}} {
						args := []string{"map"}
						if json {
							args = append(args, "--output=json")
						}
						args = append(args, "--start-offset="+fmt.Sprint(r.start))
						if r.length >= 0 {
							args = append(args, "--max-length="+fmt.Sprint(r.length))
						}
						args = append(args, "--image-opts", opts)
						q := qemu.ImgOutput(t, args...)
						q.Stdout = strings.ReplaceAll(q.Stdout, qemu.NBDFile(opts), path)
						same(t, strings.Join(args, " "), q, bitmapMapOf(t, path, name, path, r.start, r.length, json))
					}
				}
			})
		}
	}
	t.Run("in-use", func(t *testing.T) {
		p := filepath.Join(dir, "in-use.qcow2")
		qemu.Create(t, "qcow2", p, "8M")
		qemu.Img(t, "bitmap", "--add", p, "b")
		if !qemu.ExportsBitmap(t, p, "b") {
			t.Fatal("qemu-nbd does not export a bitmap that is not in use")
		}
		_, _, dirOff, _ := qemu.BitmapDirectory(t, p)
		qemu.PatchU(t, p, dirOff+12, 4, 3) // flags: in_use, auto
		if qemu.ExportsBitmap(t, p, "b") {
			t.Fatal("qemu-nbd exports a bitmap in use")
		}
		if us := bitmapMapOf(t, p, "b", p, 0, -1, true); us.Code == 0 {
			t.Errorf("a bitmap in use is mapped:\n%s", us.Stdout)
		}
	})
}
