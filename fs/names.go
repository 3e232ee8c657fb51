package fs

import (
	"fmt"
	"sort"
	"strings"
	"unicode/utf8"
)

// The naming rule: how source entries are named in the mount.
//
//  1. Folders and plain files keep their names. Source names are unique in
//     a folder, so these never clash with each other.
//  2. A qcow2 image (recognized by its magic bytes, whatever its name) is
//     named after the image with a .qcow2, .qcow or .img suffix (any case)
//     replaced by .raw; an image with any other name gets .raw appended:
//     vm.qcow2 -> vm.raw, disk -> disk.raw.
//  3. Clashes: images claim their preferred names in byte-wise order of
//     their source names, after rule 1's names are taken. An image whose
//     preferred name is taken falls back to its full source name plus
//     .raw (vm.img -> vm.img.raw), again in byte-wise order. An image whose
//     fallback is taken too is not shown, and a line is logged.
//  5. No name is longer than NAME_MAX (255 bytes): the kernel refuses the
//     whole listing of a folder with one such name. A name that would be
//     longer counts as taken, so its entry falls back or is not shown.
//
//  4. An internal snapshot of a shown image is shown next to it as
//     STEM@SNAPSHOT.raw, where STEM is the image's name without .raw and
//     SNAPSHOT the snapshot's name, escaped (below), or its ID if the name
//     is empty. If that is taken, it falls back to STEM@id-ID.raw; if that
//     is taken too, the snapshot is not shown. Snapshots claim names after
//     every image, by image name and then in the image's table order.
//
// The rule only depends on the folder's current contents, so the same
// folder always gives the same names.

var imageSuffixes = []string{".qcow2", ".qcow", ".img"}

// nameMax is NAME_MAX, the longest name a listing may carry (rule 5).
const nameMax = 255

// usable reports whether name may be given: not taken, not too long.
func usable(name string, taken func(string) bool) bool {
	return len(name) <= nameMax && !taken(name)
}

// preferredName is rule 2.
func preferredName(src string) string {
	lower := strings.ToLower(src)
	for _, s := range imageSuffixes {
		if strings.HasSuffix(lower, s) && len(src) > len(s) {
			return src[:len(src)-len(s)] + ".raw"
		}
	}
	return src + ".raw"
}

// fallbackName is the name an image gets when its preferred name is taken.
func fallbackName(src string) string { return src + ".raw" }

// assignNames applies the naming rule to a folder's entries. image[i]
// tells whether srcs[i] is a qcow2 image. It returns the exposed name of
// each entry, "" for an image that cannot be shown.
func assignNames(srcs []string, image []bool) []string {
	out := make([]string, len(srcs))
	taken := make(map[string]bool, len(srcs))
	var images []int
	for i, s := range srcs {
		if image[i] {
			images = append(images, i)
			continue
		}
		out[i] = s
		taken[s] = true
	}
	sort.Slice(images, func(a, b int) bool { return srcs[images[a]] < srcs[images[b]] })
	var losers []int
	isTaken := func(n string) bool { return taken[n] }
	for _, i := range images {
		if n := preferredName(srcs[i]); usable(n, isTaken) {
			out[i] = n
			taken[n] = true
		} else {
			losers = append(losers, i)
		}
	}
	for _, i := range losers {
		if n := fallbackName(srcs[i]); usable(n, isTaken) {
			out[i] = n
			taken[n] = true
		}
	}
	return out
}

// escapeName makes a snapshot name or ID, or a bitmap name (bitmaps.go),
// usable in a file name: '/', '%', control bytes, and bytes that are not
// valid UTF-8 become %XX. (Escaping '%' keeps it one to one: no two names
// give one file name.)
func escapeName(name string) string {
	var b strings.Builder
	for i := 0; i < len(name); {
		r, size := utf8.DecodeRuneInString(name[i:])
		if r == utf8.RuneError && size <= 1 || r < 0x20 || r == 0x7f || r == '/' || r == '%' {
			fmt.Fprintf(&b, "%%%02X", name[i])
			i++
			continue
		}
		b.WriteString(name[i : i+size])
		i += size
	}
	return b.String()
}

// snapshotNames returns the preferred and fallback names of a snapshot of
// the image shown as image (rule 4).
func snapshotNames(image, id, name string) (preferred, fallback string) {
	stem := strings.TrimSuffix(image, ".raw")
	tag := name
	if tag == "" {
		tag = id
	}
	return stem + "@" + escapeName(tag) + ".raw", stem + "@id-" + escapeName(id) + ".raw"
}
