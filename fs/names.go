package fs

import (
	"sort"
	"strings"
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
//
// The rule only depends on the folder's current contents, so the same
// folder always gives the same names.

var imageSuffixes = []string{".qcow2", ".qcow", ".img"}

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
	for _, i := range images {
		if n := preferredName(srcs[i]); !taken[n] {
			out[i] = n
			taken[n] = true
		} else {
			losers = append(losers, i)
		}
	}
	for _, i := range losers {
		if n := fallbackName(srcs[i]); !taken[n] {
			out[i] = n
			taken[n] = true
		}
	}
	return out
}
