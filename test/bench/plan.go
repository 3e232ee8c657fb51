package main

import (
	"fmt"
	"strings"
	"time"
)

// The plan: which workloads a full and a quick run measure, on which
// images, with which contestants. The workloads come from the benchmark
// sections of issues 3 (read path), 4 (lseek, sparse copies) and 5
// (compressed images).
//
// The full run fits in about 20 minutes only because qemu's export in its
// default configuration, which reads 2 GiB in about 20 s here, is not run
// where it is the same program as the tuned one: fio's 4 KiB reads stay
// below glibc's mmap threshold, so MALLOC_MMAP_THRESHOLD_ changes nothing
// there (the tuned export is left out of fio instead), and the copies
// measure SEEK_DATA/SEEK_HOLE, where both configurations run the same code
// (the tuned one, the faster reader, is kept). Everywhere else both run.

var (
	allFUSE    = []string{"qcowfs", "qemu", "qemu-tuned", "qcowmount"}
	allWithRaw = append([]string{"raw"}, allFUSE...)
	fioWho     = []string{"qcowfs", "qemu", "qcowmount"}
	copyWho    = []string{"raw", "convert", "qcowfs", "qemu-tuned", "qcowmount"}
	zstdNA     = map[string]string{"qcowmount": "libqcow 20201213 cannot open zstd images (\"unsupported incompatible features flags: 0x00000008\")"}
)

// copyImages are the images of issue 4's copy benchmark.
var copyImages = []struct{ name, title, short string }{
	{"sparse1t", "1 TiB, 256 MiB of data in 1 MiB pieces", "1 TiB sparse"},
	{"fragback", "1 GiB written backwards 64 KiB at a time", "1 GiB backwards"},
	{"fragfwd", "1 GiB written forwards in two interleaved passes", "1 GiB interleaved"},
	{"prealloc", "1 GiB preallocation=metadata, 6 MiB of data", "1 GiB prealloc=metadata"},
}

// noLseekCap bounds a sparse copy of the 1 TiB image: without SEEK_DATA a
// reader copies a terabyte of zeros, which no one waits for.
func (b *bench) noLseekCap() time.Duration {
	if b.cfg.quick {
		return 5 * time.Second
	}
	return 30 * time.Second
}

func (b *bench) plan() []*workload {
	var p []*workload
	if b.cfg.quick {
		p = b.quickPlan()
	} else {
		p = b.fullPlan()
	}
	if len(b.cfg.only) == 0 {
		return p
	}
	var out []*workload
	for _, w := range p {
		for _, o := range b.cfg.only {
			if o != "" && strings.HasPrefix(w.id, o) {
				out = append(out, w)
				break
			}
		}
	}
	return out
}

const ddWhat = "`dd if=FILE of=/dev/null bs=1M`; MB/s = file size / wall time of dd."

// ddColdWarm reads the whole image, cold then warm, in every run.
func ddColdWarm(img, what string, who []string) *workload {
	return &workload{
		id: "dd-" + img, image: img, who: who, title: "dd bs=1M of the whole " + what + " image",
		metrics: []metric{
			{id: "cold", title: "dd bs=1M, " + what + " image, cold (caches dropped first)", short: "dd " + img + ", cold", unit: mbps},
			{id: "warm", title: "dd bs=1M, " + what + " image, warm (read again right after)", short: "dd " + img + ", warm", unit: mbps},
		},
		measure: measureDDColdWarm,
		what:    ddWhat + " Per run: drop caches, read (cold), read again (warm).",
	}
}

func (b *bench) fio(img, what string, who []string) *workload {
	return &workload{
		id: "fio-" + img, image: img, who: who, title: "fio 4 KiB random read of the " + what + " image",
		metrics: []metric{{id: "iops", unit: iops, short: "fio " + img,
			title: fmt.Sprintf("fio 4 KiB random read, psync, 4 jobs, O_DIRECT, %v, %s image", b.cfg.fioTime, what)}},
		measure: measureFio,
		what:    "`fio " + strings.Join(b.fioArgs("FILE"), " ") + "`; IOPS as fio reports them.",
	}
}

func (b *bench) copyWorkload(n int, tmpfs bool, who []string) *workload {
	ci := copyImages[n]
	where := "ext4"
	if tmpfs {
		where = "tmpfs"
	}
	w := &workload{
		id: "cp-" + ci.name + "-" + where, image: ci.name, tmpfs: tmpfs, who: who,
		title: fmt.Sprintf("cp --sparse=always of the %s image, on %s", ci.title, where),
		metrics: []metric{{id: "time", unit: seconds, short: "cp " + ci.short + ", " + where,
			title: fmt.Sprintf("cp --sparse=always, %s, image and output on %s", ci.title, where)}},
		measure: measureCopy,
		what: "`cp --sparse=always FILE OUT`, or `qemu-img convert -O raw IMG OUT`, caches dropped before each. " +
			"The first copy of each contestant is checked byte for byte against the image's raw twin (made by `qemu-img convert -O raw`); du is its allocated size.",
	}
	if ci.name == "sparse1t" {
		w.timeout = b.noLseekCap()
		if tmpfs {
			w.skipIfTimedOut = "cp-sparse1t-ext4"
		}
	}
	return w
}

func compressedCopy(img string) *workload {
	return &workload{
		id: "cp-" + img, image: img, outTmpfs: true, who: []string{"convert", "qcowfs"},
		title: "cp --sparse=always of the 2 GiB " + img + " image vs qemu-img convert",
		metrics: []metric{{id: "time", unit: seconds, short: "cp " + img + " vs convert",
			title: "cp --sparse=always vs qemu-img convert -O raw, 2 GiB " + img + " image (output on tmpfs)"}},
		measure: measureCopy,
		what: "`cp --sparse=always FILE OUT` vs `qemu-img convert -O raw IMG OUT`, OUT on a tmpfs, caches dropped before each; " +
			"the first output is checked against the raw twin.",
	}
}

func (b *bench) fullPlan() []*workload {
	p := []*workload{
		ddColdWarm("plain", "2 GiB plain", allWithRaw),
		b.fio("plain", "2 GiB plain", append([]string{"raw"}, fioWho...)),
		{
			id: "guest", image: "guest", who: allWithRaw,
			title: "every file of the guest's ext4 partition, through a loop device",
			metrics: []metric{{id: "time", unit: seconds, short: "guest partition read",
				title: "guest partition read: loop device, partx, ext4 mounted ro,noload, every file read with tar"}},
			prepare: prepareGuest, measure: measureGuest,
			what: "`losetup -r -f --show FILE; partx -a LOOP; mount -t ext4 -o ro,noload LOOPp1 DIR`, then per run: drop caches, " +
				"`tar cf - . | wc -c` in DIR. The raw row reads the raw disk file through the same path.",
		},
	}
	for _, tmpfs := range []bool{false, true} {
		for n := range copyImages {
			p = append(p, b.copyWorkload(n, tmpfs, copyWho))
		}
	}
	dz := ddColdWarm("zstd", "2 GiB zstd", allFUSE)
	dz.na = zstdNA
	p = append(p,
		ddColdWarm("deflate", "2 GiB deflate", allFUSE),
		dz,
		b.fio("deflate", "2 GiB deflate", fioWho),
		compressedCopy("deflate"),
		compressedCopy("zstd"),
	)
	return p
}

// quickPlan is a subset that runs in under 3 minutes once the images
// exist, against the best peer of each workload: qemu's export runs only
// in its tuned configuration and only where it is not the slowest by far
// (it reads 2 GiB in 5 to 20 s here, qcowmount in under 2).
func (b *bench) quickPlan() []*workload {
	return []*workload{
		ddColdWarm("plain", "2 GiB plain", []string{"raw", "qcowfs", "qcowmount"}),
		b.fio("plain", "2 GiB plain", []string{"qcowfs", "qemu-tuned", "qcowmount"}),
		b.copyWorkload(0, false, []string{"raw", "convert", "qcowfs", "qemu-tuned", "qcowmount"}),
		{
			id: "dd-deflate", image: "deflate", who: []string{"qcowfs", "qcowmount"},
			title: "dd bs=1M of the whole 2 GiB deflate image, cold",
			metrics: []metric{{id: "cold", unit: mbps, short: "dd deflate, cold",
				title: "dd bs=1M, 2 GiB deflate image, cold (caches dropped first)"}},
			measure: measureDDCold,
			what: ddWhat + " Per run: drop caches, read: every cluster inflated once. " +
				"Cold rather than warm: qcowfs keeps the page cache of its files, so its warm read measures the page cache, not inflating. " +
				"qcowmount is the best deflate peer of issue 5; the full run has every peer, cold and warm.",
		},
	}
}
