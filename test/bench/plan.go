package main

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

// The plan: which workloads a full and a quick run measure, on which
// images, with which contestants. The workloads come from the benchmark
// sections of issues 3 (read path), 4 (lseek, sparse copies), 5
// (compressed images) and 7 (check).
//
// The full run's time (docs/benchmarks.md, "Run time": about 25 minutes
// on 2 busy cores) is held down mostly by running qemu's export in its
// default configuration, which reads 2 GiB in about 20 s here, where it
// makes a difference and nowhere else:
//   - not where it is the same program as the tuned one: fio's 4 KiB
//     reads stay below glibc's mmap threshold, so MALLOC_MMAP_THRESHOLD_
//     changes nothing there (the tuned export is left out of fio instead),
//     and the copies measure SEEK_DATA/SEEK_HOLE, where both
//     configurations run the same code (the tuned one, the faster reader,
//     is kept);
//   - not for a warm read once its cold read has shown that the page
//     cache is dropped at open (fincore: 0% cached): its warm read is
//     then one more read through the daemon, which the cold one measured
//     already (20 s for the plain image, 11 s for deflate). The tuned
//     export's warm read still shows qemu's.
//
// Everywhere else both run. Other savings: fio runs 3 s, not 4; a sparse
// copy without SEEK_DATA is cut off after 10 s, not 30 (it would copy a
// terabyte); the copies of the baselines are not compared with the raw
// twin they are by construction, a peer's only once per image. The strace
// passes (syscalls.go) add one untimed copy or read per traced daemon.

var (
	allFUSE    = []string{"qcowfs", "qemu", "qemu-tuned", "qcowmount"}
	allWithRaw = append([]string{"raw"}, allFUSE...)
	fioWho     = []string{"qcowfs", "qemu", "qcowmount"}
	copyWho    = []string{"raw", "convert", "qcowfs", "qemu-tuned", "qcowmount"}
	zstdNA     = map[string]string{"qcowmount": "libqcow 20201213 cannot open zstd images (\"unsupported incompatible features flags: 0x00000008\")"}
	// qemuWarmSkip: qemu's default export skips a warm read its cold read
	// has shown to be uncached (see above).
	qemuWarmSkip = []string{"qemu"}
)

// copyImages are the images of issue 4's copy benchmark.
var copyImages = []struct{ name, title, short string }{
	{"sparse1t", "1 TiB, 256 MiB of data in 1 MiB pieces", "1 TiB sparse"},
	{"fragback", "1 GiB written backwards 64 KiB at a time", "1 GiB backwards"},
	{"fragfwd", "1 GiB written forwards in two interleaved passes", "1 GiB interleaved"},
	{"prealloc", "1 GiB preallocation=metadata, 6 MiB of data", "1 GiB prealloc=metadata"},
}

// noLseekCap bounds a sparse copy of the 1 TiB image: without SEEK_DATA a
// reader copies a terabyte of zeros, which no one waits for (at 2 GB/s,
// nine minutes). 10 s is over ten times what the readers with SEEK_DATA
// take.
func (b *bench) noLseekCap() time.Duration {
	if b.cfg.quick {
		return 5 * time.Second
	}
	return 10 * time.Second
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
	method := ddWhat + " Per run: drop caches, read (cold), read again (warm)."
	if slices.Contains(who, "qemu") {
		method += " qemu's default export skips the warm read when the cold one left nothing in the page cache (it is dropped at open): " +
			"it would be one more read through the daemon; the tuned export's warm read is measured."
	}
	return &workload{
		id: "dd-" + img, image: img, who: who, title: "dd bs=1M of the whole " + what + " image",
		metrics: []metric{
			{id: "cold", title: "dd bs=1M, " + what + " image, cold (caches dropped first)", short: "dd " + img + ", cold", unit: mbps},
			{id: "warm", title: "dd bs=1M, " + what + " image, warm (read again right after)", short: "dd " + img + ", warm", unit: mbps},
		},
		measure: measureDDColdWarm, skipWarmWhenUncached: qemuWarmSkip,
		what: method,
	}
}

// ddCold reads a compressed image cold in every run. Cold only: qcowfs
// keeps the page cache of its files, so its warm read measures the page
// cache, not inflating, and the peers have the page cache dropped at
// every open, so their warm read is one more cold one.
func ddCold(img string, who []string) *workload {
	what := "2 GiB " + img
	return &workload{
		id: "dd-" + img, image: img, who: who, title: "dd bs=1M of the whole " + what + " image, cold",
		metrics: []metric{{id: "cold", unit: mbps, short: "dd " + img + ", cold",
			title: "dd bs=1M, " + what + " image, cold (caches dropped first)"}},
		measure: measureDDCold,
		what: ddWhat + " Per run: drop caches, read: every cluster inflated once. " +
			"Cold only: qcowfs keeps the page cache of its files, so its warm read measures the page cache (the plain image's warm row shows that), " +
			"and the peers drop the page cache at every open, so their warm read is one more cold one.",
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
		measure: measureCopy, syscalls: copySyscalls(tracedDaemons...),
		what: "`cp --sparse=always FILE OUT`, or `qemu-img convert -O raw IMG OUT`, caches dropped before each. " +
			"The first copy of qcowfs, and of each peer once per image, is checked byte for byte against the image's raw twin " +
			"(made by `qemu-img convert -O raw`; the baselines' copies are that twin by construction); du is the first copy's allocated size.",
	}
	if tmpfs {
		// qemu asks the host file about holes with lseek only, which a
		// tmpfs answers as ext4 does: its counts here are those on ext4
		// (checked: 9 lseek and ~4100 reads for the prealloc image on
		// both), and tracing it costs a copy at a third of its speed.
		// qcowfs is traced: a tmpfs has no FIEMAP, so it uses lseek.
		w.syscalls = copySyscalls("qcowfs")
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
		measure: measureCopy, syscalls: copySyscalls("qcowfs"),
		what: "`cp --sparse=always FILE OUT` vs `qemu-img convert -O raw IMG OUT`, OUT on a tmpfs, caches dropped before each; " +
			"qcowfs's first output is checked against the raw twin.",
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
	dd := ddCold("deflate", allFUSE)
	dz := ddCold("zstd", allFUSE)
	dz.na = zstdNA
	dd.syscalls = compressedReadSyscalls()
	// qemu reads once per cluster on both (1.005 and 1.013 in trial
	// runs, 35 s a traced run): traced on deflate only.
	dz.syscalls = compressedReadSyscalls()
	dz.syscalls.who = []string{"qcowfs"}
	p = append(p,
		dd,
		dz,
		b.fio("deflate", "2 GiB deflate", fioWho),
		compressedCopy("deflate"),
		compressedCopy("zstd"),
		checkWorkload(0), // sparse1t
		checkWorkload(1), // fragback
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
		func() *workload {
			w := ddCold("deflate", []string{"qcowfs", "qcowmount"})
			w.syscalls = compressedReadSyscalls()
			w.what += " qcowmount is the best deflate peer of issue 5; the full run has every peer."
			return w
		}(),
		checkWorkload(0), // sparse1t
	}
}
