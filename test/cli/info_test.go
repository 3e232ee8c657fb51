package cli

// Command line tests: qcowfs info, map and check print what qemu-img
// prints, byte for byte, over the whole test matrix; and what they say
// where qemu-img has nothing to compare.

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
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
	add := func(name, path string) { images = append(images, qemu.Image{Name: name, Path: path}) }

	dirty := filepath.Join(dir, "dirty.qcow2")
	qemu.Create(t, "qcow2", dirty, "1M", "-o", "lazy_refcounts=on")
	qemu.IO(t, dirty, "write -P 0x12 0 4k")
	qemu.SetIncompatible(t, dirty, 1)
	add("dirty", dirty)
	corrupt := filepath.Join(dir, "corrupt.qcow2")
	qemu.Create(t, "qcow2", corrupt, "1M")
	qemu.IO(t, corrupt, "write -P 0x12 0 4k")
	qemu.SetIncompatible(t, corrupt, 2)
	add("corrupt", corrupt)
	bitmaps := filepath.Join(dir, "bitmaps.qcow2")
	qemu.Create(t, "qcow2", bitmaps, "4M")
	qemu.Img(t, "bitmap", "--add", bitmaps, "on")
	qemu.Img(t, "bitmap", "--add", "--disable", "-g", "512k", bitmaps, "off") // no flags: an empty list
	add("bitmaps", bitmaps)
	for _, format := range []string{"luks", "aes"} {
		p := filepath.Join(dir, format+".qcow2")
		qemu.CreateEncrypted(t, p, format)
		add(format, p)
	}
	odd := filepath.Join(dir, "odd size.raw")
	if err := os.WriteFile(odd, bytes.Repeat([]byte("raw!"), 2500), 0o644); err != nil {
		t.Fatal(err)
	}
	add("raw-odd-size", odd)
	sparse := filepath.Join(dir, "sparse.raw")
	qemu.Create(t, "raw", sparse, "3M")
	add("raw-sparse", sparse)
	text := writeFile(t, filepath.Join(dir, "text.qcow2"), strings.Repeat("not a qcow2 image\n", 100))
	add("text", text)
	// A name with a space, a quote, a backslash and non-ASCII letters,
	// which qemu's JSON escapes its own way.
	strange := filepath.Join(dir, `vm "ü" \ 東.qcow2`)
	qemu.Create(t, "qcow2", strange, "1M", "-b", filepath.Base(images[0].Path), "-F", "qcow2")
	add("strange-name", strange)
	// Other compression, refcount width and an absolute backing name.
	zstd := filepath.Join(dir, "zstd.qcow2")
	qemu.Create(t, "qcow2", zstd, "3M", "-o", "compression_type=zstd,refcount_bits=1,extended_l2=on,cluster_size=16384", "-b", images[0].Path, "-F", "qcow2")
	add("zstd", zstd)
	// The first 4, 7 and 8 bytes of a version 2 image: the first two are
	// raw to qemu (the version reads as 0), the third a qcow2 image too
	// short to open.
	for _, n := range []int{4, 7, 8} {
		name := fmt.Sprintf("short-%d", n)
		p := filepath.Join(dir, name+".qcow2")
		head := make([]byte, n)
		f, err := os.Open(images[0].Path)
		if err != nil {
			t.Fatal(err)
		}
		f.ReadAt(head, 0)
		f.Close()
		if err := os.WriteFile(p, head, 0o644); err != nil {
			t.Fatal(err)
		}
		add(name, p)
	}
	orphan := filepath.Join(dir, "orphan.qcow2")
	qemu.Img(t, "create", "-q", "-u", "-f", "qcow2", "-b", "gone.qcow2", "-F", "qcow2", orphan, "1M")
	add("orphan", orphan)

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
	base := filepath.Join(dir, "base.qcow2")
	qemu.Create(t, "qcow2", base, "2M")
	qemu.IO(t, base, "write -P 0x5a 64k 64k")
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
