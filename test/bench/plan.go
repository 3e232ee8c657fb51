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
// The full run's time (docs/benchmarks.md, "Run time: the strace passes
// and stalled commands": 26 to 27 minutes on 2 busy cores) is held down
// mostly by running qemu's export in its default configuration, which
// reads 2 GiB in about 20 s here, where it makes a difference and nowhere
// else:
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
	matches := func(w *workload, prefixes []string) bool {
		for _, o := range prefixes {
			if o != "" && strings.HasPrefix(w.id, o) {
				return true
			}
		}
		return false
	}
	var out []*workload
	for _, w := range p {
		if (len(b.cfg.only) == 0 || matches(w, b.cfg.only)) && !matches(w, b.cfg.skip) {
			out = append(out, w)
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
	// The compressed images: 3 runs, not defaultRuns. Every run inflates 2 GiB
	// through every reader (qcowmount takes 25 to 30 s a run, qemu's
	// exports 15 to 20 s), and qcowfs's lead over the best peer there
	// (1.4x to 2.5x in earlier runs) is wider than the spread of its
	// runs: this saves about 5 minutes of a full run.
	dd := ddCold("deflate", allFUSE)
	dz := ddCold("zstd", allFUSE)
	dz.na = zstdNA
	dd.syscalls = compressedReadSyscalls()
	dz.syscalls = compressedReadSyscalls()
	fd := b.fio("deflate", "2 GiB deflate", fioWho)
	cd, cz := compressedCopy("deflate"), compressedCopy("zstd")
	for _, w := range []*workload{dd, dz, fd, cd, cz} {
		w.runs = compressedRuns
	}
	p = append(p,
		dd,
		dz,
		fd,
		cd,
		cz,
		checkWorkload(0), // sparse1t
		checkWorkload(1), // fragback
	)
	p = append(p, b.writePlan(false)...)
	return append(p, b.remoteWorkloads([]time.Duration{0, 20 * time.Millisecond}, false)...)
}

// compressedRuns is the runs per contestant of the compressed images'
// workloads (fullPlan).
const compressedRuns = 3

// quickPlan is a subset that runs in about 3 minutes once the images
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
		b.writePlan(true)[0],
	}
}

// The write workloads (writes.go): issue 16's benchmark section. Each
// contestant writes a fresh image of its own (qemu-img create; the raw
// baseline a raw file made the same way) and every image is checked
// through qemu after the run. 3 runs, not defaultRuns: each run makes, writes,
// closes and checks a fresh image, and the spread of trial runs was
// small next to the ratios. qemu's export runs in both configurations
// where its buffers reach glibc's mmap threshold (128 KiB: the 1 MiB
// sequential writes, the loop device's requests of the guest file
// system); for 4 KiB and 64 KiB writes the tuned one is the same program
// and only the default runs.
var (
	writeWho     = []string{"raw", "qcowfs", "qemu"}
	writeWhoBig  = []string{"raw", "qcowfs", "qemu", "qemu-tuned"}
	writeRuns    = 3
	randseed     = "--randseed=1601"
	fioWriteWhat = " Each 4 KiB block carries fio's verification header (its offset and a crc32c): after the run the image is closed " +
		"and read back by qemu (`qemu-img convert -O raw`), and `fio --verify_only` replays the job over it, reading exactly the blocks written; " +
		"with `qemu-img check` clean, that is the first run's check (`qemu-img check` alone after the others)."
)

// randWrite is fio's 4 KiB random write, 4 jobs (each in its own quarter
// of the disk, so that no block is written twice and every block can be
// verified), O_DIRECT, for --fio-time.
func (b *bench) randWrite(full bool, who []string) *workload {
	size, region, id, what := 8*gib, "2g", "w-randwrite-empty", "an empty 8 GiB image (every write allocates a cluster)"
	if full {
		size, region, id, what = 2*gib, "512m", "w-randwrite-full", "a fully allocated 2 GiB image (overwrites)"
	}
	job := []string{"--name=randwrite", "--rw=randwrite", "--bs=4k", "--ioengine=psync", "--direct=1", "--numjobs=4",
		"--size=" + region, "--offset_increment=" + region, "--group_reporting", "--randrepeat=1", randseed, "--verify=crc32c"}
	short := "fio randwrite 4K, empty"
	if full {
		short = "fio randwrite 4K, allocated"
	}
	image := "A fresh empty 8 GiB qcow2 image (64 KiB clusters) per run and contestant."
	if full {
		image = "A fully allocated 2 GiB qcow2 image (`qemu-img create -o preallocation=full`) per contestant, overwritten by each of its runs."
	}
	title := fmt.Sprintf("fio 4 KiB random write, psync, 4 jobs, O_DIRECT, %v, into %s", b.cfg.fioTime, what)
	return &workload{
		id: id, who: who, runs: writeRuns, title: title,
		metrics: []metric{
			{id: "iops", unit: iops, short: short, title: title + ": IOPS"},
			{id: "p50", unit: millis, short: short + ", p50 latency", title: "the same: median write latency (fio clat p50)", detail: true},
			{id: "p99", unit: millis, short: short + ", p99 latency", title: "the same: p99 write latency (fio clat p99)"},
			{id: "max", unit: millis, short: short + ", worst latency", title: "the same: worst write latency (fio lat max)", unsettled: true},
			{id: "cpu", unit: micros, short: short + ", daemon CPU per write", title: "the same: the daemon's CPU time (user + system, /proc/PID/stat) per write"},
		},
		measure: measureFioWrite,
		write:   &writeSpec{size: size, full: full, fio: job, timed: true, image: image, verify: verifyFio},
		what:    "`fio " + strings.Join(job, " ") + " --filename=FILE --time_based --runtime=" + fmt.Sprint(int(b.cfg.fioTime.Seconds())) + "s`." + fioWriteWhat,
	}
}

func (b *bench) writePlan(quick bool) []*workload {
	if quick {
		// qcowfs against qemu's export, 2 runs: each run makes, writes
		// and checks an 8 GiB image, and with the raw file and 3 runs
		// this one workload took 1m43s of the quick run's 4m07s.
		w := b.randWrite(false, []string{"qcowfs", "qemu"})
		w.runs = 2
		return []*workload{w}
	}
	cowJob := []string{"--name=cow", "--rw=write", "--bs=64k", "--offset=1k", "--size=256m", "--offset_increment=256m",
		fmt.Sprintf("--numjobs=%d", cowJobs), "--ioengine=psync", "--direct=1", "--group_reporting", "--verify=crc32c"}
	fsyncJob := []string{"--name=fsync", "--rw=randwrite", "--bs=4k", "--ioengine=psync", "--fsync=1", "--numjobs=1", "--size=8g",
		"--randrepeat=1", randseed, "--verify=crc32c"}
	empty := "A fresh empty 8 GiB qcow2 image (64 KiB clusters) per run and contestant."
	fsyncTitle := fmt.Sprintf("fio 4 KiB random write, buffered, fsync after every write, 1 job, %v, into an empty 8 GiB image", b.cfg.fioTime)
	return []*workload{
		b.randWrite(false, writeWho),
		b.randWrite(true, writeWho),
		{
			id: "w-cow64k", who: []string{"raw", "qemu-img-bench", "qcowfs", "qemu"}, runs: writeRuns,
			title: "64 KiB writes at a 1 KiB offset into an empty image: copy-on-write at both ends of every write",
			metrics: []metric{
				{id: "mbps", unit: mbps, short: "64K writes at 1K offset", title: "64 KiB writes at a 1 KiB offset, 1 GiB in all, into an empty 8 GiB image: MB/s"},
				{id: "host", unit: factor, short: "64K writes at 1K offset, host bytes per guest byte",
					title: "the same: bytes written to the host per guest byte (wchar of /proc/PID/io; target at most 1.1x: no zeros written for empty copy-on-write areas)", unsettled: true},
			},
			measure: measureCow,
			write:   &writeSpec{size: 8 * gib, fio: cowJob, image: empty, verify: verifyCow},
			what: fmt.Sprintf("Through a file: `fio %s --filename=FILE` (4 sequential writers, each 256 MiB from 1 KiB + N × 256 MiB). "+
				"qemu-img bench: `qemu-img %s` on the image itself (the same 16384 writes, one stream at queue depth 64, host O_DIRECT), "+
				"qemu's write path without FUSE. MB/s = 1 GiB / wall time of the command. Host bytes: wchar of the daemon's /proc/PID/io "+
				"(bytes passed to write system calls: host writes, and 24-byte FUSE replies); for the raw file and qemu-img bench, of a shell around the command "+
				"(a reaped child's counts go to its parent; fio's and qemu-img's own output is a few KiB). Checked: fio's blocks as in the random writes; qemu-img bench's pattern byte over exactly "+
				"the range written, zeros elsewhere.", strings.Join(cowJob, " "), strings.Join(qemuImgBenchArgs("IMG"), " ")),
		},
		{
			id: "w-seq1m", who: writeWhoBig, runs: writeRuns,
			title: "sequential 1 MiB writes of 2 GiB into an empty image, then fsync",
			metrics: []metric{{id: "mbps", unit: mbps, short: "seq 1M writes, 2 GiB",
				title: "dd bs=1M oflag=direct conv=fsync of 2 GiB of real files into an empty 8 GiB image"}},
			measure: measureSeq,
			write:   &writeSpec{size: 8 * gib, uses: []string{"plain"}, image: empty, prepare: prepareSeq, verify: verifySeq},
			what: "`dd if=plain.raw of=FILE bs=1M count=2048 iflag=fullblock oflag=direct conv=notrunc,fsync`: the plain image's raw twin " +
				"(2 GiB of real files, read from the page cache) written into the empty image; MB/s = 2 GiB / wall time of dd, the final fsync included. " +
				"Checked: `qemu-img compare -f raw -F qcow2 plain.raw IMG` (the rest of the image must read as zeros).",
		},
		{
			id: "w-fsync", who: writeWho, runs: writeRuns, title: fsyncTitle,
			metrics: []metric{
				{id: "iops", unit: iops, short: "fsync'ed 4K writes", title: fsyncTitle + ": writes per second"},
				{id: "sync-p99", unit: millis, short: "fsync'ed 4K writes, p99 fsync latency", title: "the same: p99 fsync latency (fio sync lat p99)"},
				{id: "sync-max", unit: millis, short: "fsync'ed 4K writes, worst fsync latency", title: "the same: worst fsync latency", detail: true, unsettled: true},
			},
			measure: measureFioWrite,
			write:   &writeSpec{size: 8 * gib, fio: fsyncJob, timed: true, image: empty, verify: verifyFio},
			what:    "`fio " + strings.Join(fsyncJob, " ") + " --filename=FILE --time_based --runtime=" + fmt.Sprint(int(b.cfg.fioTime.Seconds())) + "s`." + fioWriteWhat,
		},
		{
			id: "w-guest", who: writeWhoBig, runs: writeRuns,
			title: "a guest file system: mkfs.ext4, untar, sync, fstrim, through a loop device",
			metrics: []metric{
				{id: "time", unit: seconds, short: "guest mkfs + untar + sync",
					title: fmt.Sprintf("mkfs.ext4 on a loop device over the file, mount, untar %d MiB of /usr files, sync", treeShareMiB+treeLibMiB)},
				{id: "fstrim", unit: seconds, short: "guest fstrim", title: fmt.Sprintf("the same, after deleting %d MiB of it: fstrim", treeLibMiB)},
			},
			measure: measureGuestWrite,
			write:   &writeSpec{size: 8 * gib, image: empty, prepare: prepareTree, verify: verifyGuest},
			what: "Timed: `losetup -f --show FILE`, then `mkfs.ext4 -q -F LOOP; mount LOOP DIR; tar -xf tree.tar -C DIR; sync -f DIR` " +
				fmt.Sprintf("(tree.tar: %d MiB of files from /usr/share and %d MiB from /usr/lib, made once); then, untimed, `rm -rf DIR/lib; sync -f DIR`, ", treeShareMiB, treeLibMiB) +
				"and timed, `fstrim -v DIR` (mkfs's discard and fstrim reach the image as fallocate(PUNCH_HOLE) through the loop device). " +
				"Then the guest is unmounted, the loop device detached, the image closed. Checked: `qemu-img check`; `qemu-img convert -O raw`, " +
				"`e2fsck -fn` of that, and `tar -d` of the files kept against the tar, through a read-only loop mount.",
		},
	}
}
