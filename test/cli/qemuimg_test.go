package cli

// Command line tests: qcowfs info, map and check print what qemu-img
// prints, byte for byte, over the whole test matrix; and what they say
// where qemu-img has nothing to compare.

import (
	"errors"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestQemuImgDiff: for every image of the matrix, and encrypted, raw,
// dirty and corrupt images, a bitmap without flags and a file name that
// JSON must escape, `qcowfs info|map|check` (human and json, with
// --backing-chain, --start-offset and --max-length, -f raw) print exactly
// what `qemu-img` prints and exit with its status, and say on stderr what
// it says (check's findings, map's refusal of compressed clusters); where
// qemu-img cannot open the image, qcowfs fails too (the reasons are its
// own). Files that start with the qcow2 magic but are shorter than its
// version field are probed as qemu probes them (raw unless the version,
// read as zeros past the end, is not zero).
//
// What legitimately differs: qemu 8.0 and later describe the image's
// protocol node ("children", "Child node '/file'"), which qcowfs does
// not have; with such a qemu, info is compared without it. map's
// "compressed" key follows the installed qemu-img (map --compressed=auto).
func TestQemuImgDiff(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	dir := qemu.TempDir(t)
	images := qemu.Matrix(t, dir)
	images = append(images, qemu.FormImages(t, dir, images[0].Path)...)
	add := func(name, path string) { images = append(images, qemu.Image{Name: name, Path: path}) }
	bitmaps := filepath.Join(dir, "bitmaps.qcow2")
	qemu.Create(t, "qcow2", bitmaps, "4M")
	qemu.Img(t, "bitmap", "--add", bitmaps, "on")
	qemu.Img(t, "bitmap", "--add", "--disable", "-g", "512k", bitmaps, "off") // no flags: an empty list
	add("bitmaps", bitmaps)
	add("text", writeFile(t, filepath.Join(dir, "text.qcow2"), strings.Repeat("not a qcow2 image\n", 100)))

	newQemu := qemu.Major(t) >= 8
	for _, im := range images {
		t.Run(im.Name, func(t *testing.T) {
			runs := [][]string{}
			for _, out := range []string{"human", "json"} {
				o := "--output=" + out
				if !newQemu {
					runs = append(runs, []string{"info", o, im.Path}, []string{"info", "--backing-chain", o, im.Path})
				}
				runs = append(runs,
					[]string{"map", o, im.Path},
					[]string{"map", o, "--start-offset=1000", "--max-length=3000000", im.Path},
					// Empty ranges: past the end, and of no length.
					[]string{"map", o, "--start-offset=1T", im.Path},
					[]string{"map", o, "--start-offset=4096", "--max-length=0", im.Path},
					[]string{"check", o, im.Path},
					[]string{"info", "-f", "raw", o, im.Path},
					[]string{"map", "-f", "raw", o, im.Path},
					[]string{"check", "-f", "raw", o, im.Path},
				)
			}
			// Relative names, as given, in "filename" and the
			// backing file's "actual path".
			runs = append(runs, []string{"info", "--backing-chain", filepath.Base(im.Path)}, []string{"map", filepath.Base(im.Path)})
			for _, args := range runs {
				if newQemu && args[0] == "info" {
					continue
				}
				q, us := harness.Both(t, dir, args...)
				harness.SameAsQemu(t, strings.Join(args, " "), q, us)
			}
		})
	}
}

// TestInfoErrors: info on something that is no image file says why in one
// line and fails; an encrypted image, which info describes, is refused by
// the mount with the encryption named.
func TestInfoErrors(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "nosuch.qcow2")
	for _, c := range []struct {
		path  string
		words []string
	}{
		{missing, []string{missing, "no such file"}},
		{dir, []string{dir, "directory"}},
	} {
		for _, cmd := range []string{"info", "map", "check"} {
			for _, format := range []string{"human", "json"} {
				r := harness.Run(t, cmd, "--output="+format, c.path)
				harness.WantError(t, "qcowfs "+cmd+" --output="+format+" "+c.path, r, c.words...)
			}
		}
	}
	harness.RequireFUSE(t)
	for _, format := range []string{"luks", "aes"} {
		src := t.TempDir()
		img := filepath.Join(src, format+".qcow2")
		qemu.CreateEncrypted(t, img, format)
		mnt := t.TempDir()
		harness.Cleanup(t, mnt)
		r := harness.Run(t, "mount", img, mnt)
		harness.WantError(t, "qcowfs mount "+img, r, img, "encrypted: no key given")
		if harness.MountAt(t, mnt) != nil {
			t.Errorf("the refused encrypted image %s was mounted", img)
		}
	}
}

// TestFormatFlag: -f qcow2 and -f raw (also as --format=, --format and
// -fFMT) are taken by info, map and check as qemu-img takes them, on
// qcow2 images (one with a backing file), a raw disk and a text file:
// same stdout, same exit status. Where the format does not fit the file
// (-f qcow2 on a raw file), both fail with status 1 and a message naming
// the file and the format; -f raw on a qcow2 image shows its bytes as a
// raw disk, as qemu-img does. A format qcowfs does not read fails like
// qemu-img's unknown or mismatching driver, naming the format.
func TestFormatFlag(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	dir := qemu.TempDir(t)
	base := qemu.Make(t, filepath.Join(dir, "base.qcow2"), "2M", "write -P 0x5a 64k 64k")
	top := filepath.Join(dir, "top.qcow2")
	qemu.Create(t, "qcow2", top, "2M", "-b", "base.qcow2", "-F", "qcow2")
	qemu.IO(t, top, "write -P 0xa5 1M 4k")
	disk := filepath.Join(dir, "disk.raw")
	qemu.Img(t, "convert", "-O", "raw", top, disk)
	text := writeFile(t, filepath.Join(dir, "notes.txt"), strings.Repeat("not an image\n", 50))

	mismatch := map[string]bool{disk: true, text: true} // for -f qcow2
	newQemu := qemu.Major(t) >= 8
	for _, img := range []string{base, top, disk, text} {
		for _, format := range []string{"qcow2", "raw"} {
			flags := [][]string{{"-f", format}}
			if img == top || img == disk {
				// The other spellings getopt allows.
				flags = append(flags, []string{"--format=" + format}, []string{"--format", format}, []string{"-f" + format})
			}
			for _, flag := range flags {
				for _, cmd := range []string{"info", "map", "check"} {
					for _, out := range []string{"human", "json"} {
						args := append(append([]string{cmd}, flag...), "--output="+out, filepath.Base(img))
						if cmd == "info" && newQemu {
							continue // the protocol node: see TestQemuImgDiff
						}
						what := strings.Join(args, " ")
						q, us := harness.Both(t, dir, args...)
						harness.SameAsQemu(t, what, q, us)
						if q.Code != us.Code {
							continue
						}
						if format == "qcow2" && mismatch[img] {
							if q.Code != 1 {
								t.Errorf("%s: qemu-img exits %d; the test expects qemu-img to refuse a raw file as qcow2", what, q.Code)
							}
							harness.WantError(t, "qcowfs "+what, us, filepath.Base(img), "qcow2")
						}
					}
				}
			}
		}
	}
	for _, format := range []string{"vmdk", "nosuch", "QCOW2"} {
		for _, cmd := range []string{"info", "map", "check"} {
			args := []string{cmd, "-f", format, filepath.Base(base)}
			q, us := harness.Both(t, dir, args...)
			what := strings.Join(args, " ")
			if q.Code != 1 || q.Stderr == "" {
				t.Errorf("%s: qemu-img exits %d (%q); the test expects it to fail", what, q.Code, q.Stderr)
			}
			if us.Code != q.Code {
				t.Errorf("%s: qcowfs exits %d, qemu-img %d", what, us.Code, q.Code)
			}
			harness.WantError(t, "qcowfs "+what, us, filepath.Base(base), `"`+format+`"`)
		}
	}
}

// TestMapCommand compares `qcowfs map` with `qemu-img map`, JSON and
// human output, on the status matrix (the image's pages dropped from the
// page cache first: harness.Both). The only difference allowed: the
// JSON entries carry "compressed" (as qemu 8 and later print it), which
// qemu 7.2 omits; it is compared when qemu prints it.
func TestMapCommand(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	dir := qemu.TempDir(t)
	for _, im := range qemu.StatusMatrix(t, dir) {
		t.Run(im.Name, func(t *testing.T) {
			q, us := harness.Both(t, dir, "map", "--output=json", im.Path)
			harness.WantOK(t, "qemu-img map --output=json", q)
			harness.WantOK(t, "qcowfs map --output=json", us)
			var got, want []qemu.MapEntry
			us.JSON(t, &got)
			q.JSON(t, &want)
			for i := range got {
				if i < len(want) && want[i].Compressed == nil {
					got[i].Compressed = nil
				}
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("qcowfs map --output=json differs from qemu-img map")
			}

			q, us = harness.Both(t, dir, "map", im.Path)
			if q.Code != 0 {
				// qemu-img refuses to print compressed images in
				// human form; so do we.
				if us.Code == 0 || !strings.Contains(q.Stderr, "compressed") {
					t.Errorf("qemu-img map failed (exit %d: %s), qcowfs map exits %d", q.Code, q.Stderr, us.Code)
				}
				return
			}
			if us.Code != 0 || us.Stdout != q.Stdout {
				t.Errorf("qcowfs map differs from qemu-img map:\n%s%s\nqemu-img:\n%s", us.Stdout, us.Stderr, q.Stdout)
			}
		})
	}
}

// checkImages is the matrix plus images the check must cover: snapshots
// (in the matrix), persistent bitmaps with dirty bits, compressed
// clusters, extended L2, external data files.
func checkImages(t *testing.T, dir string) []qemu.Image {
	images := qemu.StatusMatrix(t, dir)
	bm := filepath.Join(dir, "bitmaps.qcow2")
	qemu.Create(t, "qcow2", bm, "16M")
	qemu.Img(t, "bitmap", "--add", bm, "bm0")
	qemu.Img(t, "bitmap", "--add", "-g", "512k", bm, "bm1")
	qemu.IO(t, bm, "write -P 0x42 0 3M", "write -P 0x43 10M 64k")
	return append(images, qemu.Image{Name: "bitmaps", Path: bm})
}

// TestCheckMatchesQemu: on every clean image, qcowfs check prints what
// qemu-img check prints (JSON, every field) and exits the same way.
func TestCheckMatchesQemu(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	dir := qemu.TempDir(t)
	for _, im := range checkImages(t, dir) {
		t.Run(im.Name, func(t *testing.T) {
			q, us := harness.Both(t, dir, "check", "--output=json", im.Path)
			var want, got map[string]any
			q.JSON(t, &want)
			us.JSON(t, &got)
			if !reflect.DeepEqual(got, want) || us.Code != q.Code {
				t.Errorf("qcowfs check (exit %d):\n%v\nqemu-img check (exit %d):\n%v", us.Code, got, q.Code, want)
			}
		})
	}
}

// TestCheckDamaged damages images on purpose (qemu.Damaged); qcowfs check
// must find each problem as qemu-img check does: the same lines on stderr
// (qemu's messages, word for word), the same summary and JSON, the same
// exit status. Reading the damaged range through the mount must fail with
// EIO where it would otherwise hand out metadata.
func TestCheckDamaged(t *testing.T) {
	src := harness.SourceDir(t)
	const cs = 65536
	for _, im := range qemu.Damaged(t, src) {
		t.Run(im.Name, func(t *testing.T) {
			if c := harness.Exec(t, "qemu-img", "check", im.Path); c.Code == 0 {
				t.Fatalf("qemu-img check finds nothing wrong with %s: %s", im.Name, c.Stdout)
			}
			for _, out := range []string{"human", "json"} {
				args := []string{"check", "--output=" + out, im.Path}
				q, us := harness.Both(t, src, args...)
				harness.SameAsQemu(t, strings.Join(args, " "), q, us)
			}
		})
	}
	m := harness.Mount(t, src, "--allow-corrupt")
	// Cluster 2 of l2-into-l1 points into the L1 table: reading it must
	// fail rather than return the table's bytes as guest data.
	f := harness.Open(t, filepath.Join(m.Dir, "l2-into-l1.raw"))
	if _, err := f.ReadAt(make([]byte, 4096), 2*cs); !errors.Is(err, syscall.EIO) {
		t.Errorf("reading guest data that points into the L1 table: %v, want EIO", err)
	}
	if _, err := f.ReadAt(make([]byte, 4096), 0); err != nil {
		t.Errorf("reading intact data of the damaged image: %v", err)
	}
}
