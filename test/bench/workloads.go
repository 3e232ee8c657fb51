package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"time"
)

// A workload is one piece of work that every contestant does in turn, as
// data: run.go's one loop runs them all. Commands are bash, with the
// variables of setup (targets.go).
type workload struct {
	id, title string
	group     string // the report's section
	image     string // the cached image read (images.go); for writes, the source data
	fresh     int64  // or: the size of a new image, made for every run, that the command writes
	prealloc  bool   // ... fully allocated (preallocation=full)
	// encrypted: the image is (the fresh images are made) LUKS-encrypted;
	// clear contestants get the same data unencrypted.
	encrypted bool
	tmpfs     bool // the image and OUT on a tmpfs
	outDisk   bool // OUT on the work folder's disk, not on the tmpfs
	// remote ("http" or "s3"): the image read over the network, through
	// test/servers' proxy, which adds rtt to every request.
	remote string
	rtt    time.Duration
	who    []string // contestants, in the order of the first round
	// keep: each contestant's mount is made once and kept for every
	// round (all of them mounted beside each other for the workload),
	// not made afresh for each run.
	keep bool

	prepare func(e *env) error // once, before the first round
	before  string             // untimed, before the command
	cold    bool               // caches dropped right before the command
	cmd     string             // the timed command of every contestant with a mount
	own     map[string]string  // the commands of the others (qemu-img convert, curl)
	after   string             // untimed, after the command, also when it failed
	// parse reads numbers from the command's output, besides the @NAME
	// lines that every command may print (run.go).
	parse func(stdout string, o *outcome) error
	// verify checks a run once its target is closed (a written image is
	// closed then); it may add a note.
	verify  func(e *env, t *target, o *outcome, round int) error
	metrics []metric      // the first is the headline
	limit   time.Duration // per command (0: 3 minutes); a contestant past it is out
	quick   []string      // its contestants in make bench-quick; nil: not in it
}

// command is what contestant c runs in w.
func (w *workload) command(c *contestant) string {
	if s, ok := w.own[c.id]; ok {
		return s
	}
	return w.cmd
}

// An outcome is what one run of one contestant measured.
type outcome struct {
	secs     float64            // the command's wall time
	timedOut bool               // ... cut off at the limit: a bound
	vals     map[string]float64 // @NAME lines, parse's numbers, the daemon's cpu and wchar, fetched bytes
	size     int64              // the image's virtual size
	fileSize int64              // its file's size
	rss      int64              // the daemon's peak RSS
	note     string
}

// addNote adds a note to the run's (what a command or check found).
func (o *outcome) addNote(s string) {
	switch {
	case s == "":
	case o.note == "":
		o.note = s
	default:
		o.note += "; " + s
	}
}

// A metric is one number per run, computed from its outcome; ok is false
// when the run has none.
type metric struct {
	name  string
	unit  string
	lower bool // lower is better
	of    func(o *outcome) (v float64, ok bool)
	// bounded: of a timed-out run it gives a bound (a time, a rate).
	bounded bool
	// count: the probe's (strace's counts), which only its row shows.
	count bool
}

// took is a wall time: the command's, or of its lap named lap.
func took(name, lap string) metric {
	return metric{name: name, unit: "s", lower: true, of: func(o *outcome) (float64, bool) {
		if lap == "" {
			return o.secs, true
		}
		v, ok := o.vals[lap]
		return v, ok
	}, bounded: lap == ""}
}

// rate is MB/s: bytes (0: the image's size) over took(lap).
func rate(name, lap string, bytes int64) metric {
	t := took(name, lap)
	return metric{name: name, unit: "MB/s", of: func(o *outcome) (float64, bool) {
		s, ok := t.of(o)
		if bytes == 0 {
			bytes = o.size
		}
		return float64(bytes) / s / 1e6, ok && s > 0
	}, bounded: lap == ""}
}

// val is a value the command reported, times scale.
func val(name, unit, key string, scale float64, lower bool) metric {
	return metric{name: name, unit: unit, lower: lower, of: func(o *outcome) (float64, bool) {
		v, ok := o.vals[key]
		return v * scale, ok
	}}
}

// count is one of the probe's counts of host calls.
func count(name, key string) metric {
	m := val(name, "calls", key, 1, true)
	m.count = true
	return m
}

var (
	iops = val("IOPS", "IOPS", "iops", 1, false)
	p99  = val("p99 latency", "ms", "p99", 1e-6, true)
	// The daemon's CPU time (user and system) in the command.
	cpuPerGiB = metric{name: "daemon CPU per GiB", unit: "s", lower: true, of: func(o *outcome) (float64, bool) {
		cpu, ok := o.vals["cpu"]
		return cpu / (float64(o.size) / (1 << 30)), ok
	}}
	cpuPerIO = metric{name: "daemon CPU per I/O", unit: "µs", lower: true, of: func(o *outcome) (float64, bool) {
		cpu, ok := o.vals["cpu"]
		return cpu / o.vals["ios"] * 1e6, ok && o.vals["ios"] > 0
	}}
	// The probe's counts (contestants.go).
	// cpuPerGiBOf is the daemon's CPU per GiB of the disk in the lap key
	// (its CPU printed as @key_cpu).
	cpuPerGiBOf = func(name, key string) metric {
		return metric{name: name, unit: "s", lower: true, of: func(o *outcome) (float64, bool) {
			cpu, ok := o.vals[key+"_cpu"]
			return cpu / (float64(o.size) / (1 << 30)), ok
		}}
	}
	rssPeak = metric{name: "daemon peak RSS", unit: "MiB", lower: true, of: func(o *outcome) (float64, bool) {
		return float64(o.rss) / (1 << 20), o.rss > 0
	}}
	lseeks  = count("host lseek", "lseek")
	fiemaps = count("host FIEMAP", "fiemap")
	perClus = metric{name: "host reads per compressed cluster", lower: true, count: true, of: func(o *outcome) (float64, bool) {
		return o.vals["reads"] / o.vals["clusters"], o.vals["clusters"] > 0
	}}
	checkRSS = val("peak RSS", "MiB", "rss", 1.0/1024, true) // GNU time's %M, KiB
)

const (
	dd       = `dd if="$FILE" of=/dev/null bs=1M status=none`
	fioRead  = `fio --name=randread --filename="$FILE" --readonly --rw=randread --bs=4k --ioengine=psync --direct=1 --numjobs=4 --group_reporting --time_based --runtime="$FIOTIME" --randrepeat=0 --norandommap --output-format=json`
	cp       = `cp --sparse=always "$FILE" "$OUT"`
	convert  = `qemu-img convert -f qcow2 -O raw "$IMG" "$OUT"`
	rssTime  = `/usr/bin/time -f "@rss %M" ` // GNU time, not the bench's wait4: Go starts children with CLONE_VM, which gives them the bench's peak
	mountGst = `dev=$(losetup -r -f --show "$FILE"); echo $dev > "$RUN/dev"; partx -a $dev 2>/dev/null || true
for i in $(seq 100); do [ -b ${dev}p1 ] && break; sleep 0.1; done
mkdir "$RUN/g"; mount -t ext4 -o ro,noload ${dev}p1 "$RUN/g"`
	tarGst = `cd "$RUN/g" && tar cf - . | wc -c`
	// reread is issue 45's sequence for one presenter whose mount is
	// kept (workload.keep): every cache dropped, the disk read cold; the
	// image file read into the host's page cache; the disk read again
	// (what the mount's page cache kept, and the daemon for the rest).
	// The daemon's CPU ($PID) of each read is printed.
	reread = `cpu() { local s; s=$(cat /proc/$PID/stat); s=${s##*) }; set -- $s; echo $(( ${12} + ${13} )); }
dropcaches; a=$(cpu); lap cold 'dd if="$FILE" of=/dev/null bs=1M status=none'; b=$(cpu)
cat "$IMG" > /dev/null; c=$(cpu); lap again 'dd if="$FILE" of=/dev/null bs=1M status=none'; d=$(cpu)
echo "@cold_cpu $(( b - a ))e-2"; echo "@again_cpu $(( d - c ))e-2"`
	// chainCached reads every layer of a chain's folder into the page cache.
	chainCached = `cat "$IMG" $(ls "$(dirname "$IMG")"/layers/*.qcow2 2>/dev/null) > /dev/null`
	// cached reads the image file into the host's page cache (the page
	// cache of a mount made for the run is empty); hot drops every cache
	// first.
	cached   = `cat "$IMG" > /dev/null; if [ "$FMT" = raw ]; then cat "$RAW" > /dev/null; fi`
	hot      = `dropcaches; ` + cached
	unmntGst = `umount "$RUN/g" || true; dev=$(cat "$RUN/dev"); partx -d $dev || true; losetup -d $dev`
)

var (
	readers = []string{"raw", "qcowfs", "qemu", "qemu-tuned", "qcowmount"}
	copiers = []string{"raw", "convert", "qcowfs", "qemu-tuned", "qcowmount", "qcowfs-strace"}
	// sameAsRaw checks a copy on its first run: the raw twin's bytes
	// (qemu-img compare reads a copy that is a qcow2 file, curl's, as one).
	sameAsRaw = verifyFirst(`qemu-img compare -q -f raw "$RAW" "$OUT"; echo "bytes = qemu's, du $(du -h "$OUT" | cut -f1)"`)
)

// readWorkloads are the local reads, copies, compressed images, check and map.
func readWorkloads() []*workload {
	ws := []*workload{
		{id: "dd-plain", title: "dd bs=1M of the 2 GiB plain image, cold", image: "plain", who: readers, cold: true, cmd: dd,
			metrics: []metric{rate("MB/s", "", 0), cpuPerGiB}, quick: []string{"raw", "qcowfs", "qemu"}},
		{id: "dd-plain-warm", title: "the same right after a cold read", image: "plain", who: readers, before: "dropcaches; " + dd, cmd: dd,
			metrics: []metric{rate("MB/s", "", 0), cpuPerGiB}},
		{id: "dd-plain-hot", title: "the same with the image file in the host's page cache, the mount's cache empty", image: "plain", who: append(readers, "qcowfs-devfuse"),
			before: hot, cmd: dd, metrics: []metric{rate("MB/s", "", 0), cpuPerGiB}},
		{id: "dd-rawfile", title: "dd bs=1M of a 2 GiB raw file in the mounted folder, cold: through the mount against reading it directly", image: "rawfile",
			who: []string{"raw", "qcowfs"}, cold: true, cmd: `dd if="$(dirname "$FILE")/plain.img" of=/dev/null bs=1M status=none`,
			own: map[string]string{"raw": dd}, metrics: []metric{rate("MB/s", "", 0), cpuPerGiB}},
		{id: "fio-plain", title: "fio 4 KiB random reads, 4 jobs, O_DIRECT, the plain image (its file in the page cache)", image: "plain",
			who: []string{"raw", "qcowfs", "qcowfs-devfuse", "qemu", "qcowmount"}, before: cached, cmd: fioRead, parse: parseFio, metrics: []metric{iops, cpuPerIO}, quick: []string{"qcowfs", "qcowfs-devfuse", "qemu"}},
		{id: "reread-plain", title: "issue 45's sequence, the three presenters mounted beside each other for every round: caches dropped, a cold read, the image file read into the page cache, the disk read again", image: "plain",
			who: []string{"qcowfs", "qemu", "qcowmount"}, keep: true, cmd: reread,
			metrics: []metric{rate("re-read MB/s", "again", 0), rate("cold MB/s", "cold", 0), cpuPerGiBOf("daemon CPU per GiB, re-read", "again"), cpuPerGiBOf("daemon CPU per GiB, cold", "cold")}},
		{id: "guest", title: "tar of every file of the guest's ext4 partition, through a loop device", image: "guest", who: readers,
			before: mountGst, cold: true, cmd: tarGst, after: unmntGst, metrics: []metric{took("time", "")}},
	}
	for _, tmpfs := range []bool{false, true} {
		for _, img := range []string{"sparse1t", "fragback", "fragfwd", "prealloc"} {
			w := &workload{id: "cp-" + img + "-ext4", title: "cp --sparse=always of " + img + ", image and output on ext4", image: img, tmpfs: tmpfs, outDisk: !tmpfs,
				who: copiers, cold: true, cmd: cp, own: map[string]string{"convert": convert}, verify: sameAsRaw,
				metrics: []metric{took("time", ""), lseeks, fiemaps},
				quick:   when(img == "sparse1t" && !tmpfs, "convert", "qcowfs", "qemu-tuned")}
			if tmpfs {
				w.id, w.title = "cp-"+img+"-tmpfs", "cp --sparse=always of "+img+", image and output on a tmpfs (no FIEMAP)"
			}
			if img == "sparse1t" {
				w.limit = 10 * time.Second // a reader without SEEK_DATA copies a terabyte of zeros
			}
			ws = append(ws, w)
		}
	}
	for _, img := range []string{"deflate", "zstd"} {
		ws = append(ws,
			&workload{id: "dd-" + img, title: "dd bs=1M of the 2 GiB " + img + " image, cold", image: img, cold: true, cmd: dd,
				who:     []string{"qcowfs", "qemu", "qemu-tuned", "qcowmount", "qcowfs-strace"},
				metrics: []metric{rate("MB/s", "", 0), cpuPerGiB, perClus}, quick: when(img == "zstd", "qcowfs", "qemu")},
			&workload{id: "dd-" + img + "-hot", title: "dd bs=1M of the " + img + " image with its file in the host's page cache", image: img,
				who: []string{"qcowfs", "qemu", "qemu-tuned"}, before: hot, cmd: dd, metrics: []metric{rate("MB/s", "", 0), cpuPerGiB}},
			&workload{id: "cp-" + img, title: "cp of the " + img + " image against qemu-img convert", image: img, cold: true,
				who: []string{"convert", "qcowfs"}, cmd: cp, own: map[string]string{"convert": convert}, verify: sameAsRaw,
				metrics: []metric{took("time", "")}})
	}
	// Backing chains (issue 45): 1 GiB spread over 1, 16 and 64 layers
	// (their bytes through qcowfs are TestChainIndexRandom's to check);
	// qcowmount does not follow backing files, so it is only in the first.
	for _, img := range []string{"chain1", "chain16", "chain64"} {
		who := []string{"qcowfs", "qemu", "qemu-tuned"}
		if img == "chain1" {
			who = append(who, "qcowmount")
		}
		ws = append(ws, &workload{id: "fio-" + img, title: "fio 4 KiB random reads, 4 jobs, O_DIRECT, " + imageNamed(img).title + " (every layer's file in the page cache)", image: img,
			who: who, before: chainCached, cmd: fioRead, parse: parseFio, metrics: []metric{iops, cpuPerIO}})
	}
	ws = append(ws, &workload{id: "fio-chain64t", title: "fio 4 KiB random reads, 4 jobs, O_DIRECT, " + imageNamed("chain64t").title + ": the daemon's memory", image: "chain64t",
		who: []string{"qcowfs", "qemu-tuned"}, before: chainCached, cmd: fioRead, parse: parseFio, metrics: []metric{rssPeak, iops, cpuPerIO}})
	for _, img := range []string{"deflate", "zstd"} {
		ws = append(ws, &workload{id: "fio-" + img, title: "fio 4 KiB random reads, 4 jobs, O_DIRECT, the " + img + " image (its file in the page cache)", image: img,
			who: []string{"qcowfs", "qemu", "qcowmount"}, before: cached, cmd: fioRead, parse: parseFio, metrics: []metric{iops, cpuPerIO}})
	}
	for _, img := range []string{"sparse1t", "fragback"} {
		ws = append(ws,
			&workload{id: "check-" + img, title: "qcowfs check against qemu-img check", image: img, who: []string{"qcowfs", "qemu-img"},
				cold: true, cmd: rssTime + `"$BIN" check "$IMG"`, metrics: []metric{took("time", ""), checkRSS}, quick: when(img == "fragback", "qcowfs", "qemu-img")},
			&workload{id: "map-" + img, title: "qcowfs map against qemu-img map, JSON", image: img, who: []string{"qcowfs", "qemu-img"},
				cold: true, cmd: rssTime + `"$BIN" map --output=json "$IMG" > "$OUT"`, metrics: []metric{took("time", ""), checkRSS},
				verify: verifyFirst(`qemu-img map --output=json "$IMG" | cmp - "$OUT"; echo "output = qemu-img's"`), quick: when(img == "fragback", "qcowfs", "qemu-img")})
	}
	for _, w := range ws {
		w.group = "Reads"
	}
	return ws
}

// encryptedWorkloads read and write LUKS AES-256-XTS images (issue 35):
// qcowfs and qemu's export with the key, beside both on the same data
// unencrypted, in the same rounds, for the cost of encryption.
func encryptedWorkloads() []*workload {
	who := []string{"qcowfs", "qemu", "qcowfs-clear", "qemu-clear"}
	ws := []*workload{
		{id: "enc-dd", title: "dd bs=1M of the 2 GiB encrypted image, cold", image: "enc", who: who, cold: true, cmd: dd,
			metrics: []metric{rate("MB/s", "", 0), cpuPerGiB}},
		{id: "enc-fio-read", title: "fio 4 KiB random reads, 4 jobs, O_DIRECT, the encrypted image (its file in the page cache)", image: "enc", who: who,
			before: `cat "$IMG" > /dev/null`, cmd: fioRead, parse: parseFio, metrics: []metric{iops, cpuPerIO}},
		{id: "enc-fio-write", title: "fio 4 KiB random writes, 4 jobs, O_DIRECT, into an empty encrypted 8 GiB image", fresh: 8 << 30, who: who,
			cmd: randWrite("2g") + timed + fioState, parse: parseFio, verify: checked(fioReplay(randWrite("2g"))),
			metrics: []metric{iops, p99, cpuPerIO}},
	}
	for _, w := range ws {
		w.group, w.encrypted = "Encrypted", true
	}
	return ws
}

// when is who if cond holds: the quick subset's contestants of a row.
func when(cond bool, who ...string) []string {
	if cond {
		return who
	}
	return nil
}

// verifyFirst runs script after a contestant's first run; its last line
// of output is the run's note.
func verifyFirst(script string) func(e *env, t *target, o *outcome, round int) error {
	return func(e *env, t *target, o *outcome, round int) error {
		if round > 1 {
			return nil
		}
		out, err := e.sh(script, t.vars...)
		o.addNote(tail(out, 1))
		return err
	}
}

// fioJob is the part of fio's JSON output that the bench reads.
type fioJob struct {
	Error int    `json:"error"`
	Read  fioDir `json:"read"`
	Write fioDir `json:"write"`
	Sync  struct {
		Lat fioLat `json:"lat_ns"`
	} `json:"sync"`
}

// decodeFio reads fio's JSON output, which must have one job group.
func decodeFio(stdout string) (fioJob, error) {
	var out struct{ Jobs []fioJob }
	stdout = stdout[max(0, strings.IndexByte(stdout, '{')):] // fio may print notes first
	if err := json.NewDecoder(strings.NewReader(stdout)).Decode(&out); err != nil {
		return fioJob{}, fmt.Errorf("fio output: %v", err)
	}
	if len(out.Jobs) != 1 || out.Jobs[0].Error != 0 {
		return fioJob{}, fmt.Errorf("fio: %d job groups, error %v", len(out.Jobs), out.Jobs)
	}
	return out.Jobs[0], nil
}

type fioDir struct {
	IOPS     float64 `json:"iops"`
	IOBytes  float64 `json:"io_bytes"`
	TotalIOs float64 `json:"total_ios"`
	Clat     fioLat  `json:"clat_ns"`
	Lat      fioLat  `json:"lat_ns"`
}

type fioLat struct {
	Max        float64            `json:"max"`
	Percentile map[string]float64 `json:"percentile"`
}

// parseFio reads fio's JSON (one group): iops, ios and bytes, the
// completion latency's p99 and the worst latency in ns, and the fsync
// latency's p99 — of the reads, or of the writes if it wrote.
func parseFio(stdout string, o *outcome) error {
	if !strings.Contains(stdout, "{") {
		return nil // not fio: qemu-img bench beside fio's writers
	}
	j, err := decodeFio(stdout)
	if err != nil {
		return err
	}
	d := j.Read
	if j.Write.TotalIOs > 0 {
		d = j.Write
	}
	if d.TotalIOs == 0 {
		return fmt.Errorf("fio did no I/O")
	}
	for k, v := range map[string]float64{"iops": d.IOPS, "ios": d.TotalIOs, "bytes": d.IOBytes, "p99": d.Clat.Percentile["99.000000"],
		"max": d.Lat.Max, "sync-p99": j.Sync.Lat.Percentile["99.000000"]} {
		o.vals[k] = v
	}
	return nil
}
