package main

import (
	"fmt"
	"path/filepath"
	"strings"
)

// The write workloads: each contestant writes an image of its own, made
// by qemu-img create for every run (the raw file: a raw one), through its
// writable mount: qcowfs mount --writable, qemu's export with writable=on,
// the raw file written directly with the same O_DIRECT flags (the
// ceiling), and qemu-img bench (qemu's own write path, no FUSE). After the
// run the daemon is stopped, which closes the image, and qemu checks it:
// qemu-img check clean after every run, and after a contestant's first run
// what was written read back through qemu. A run that fails its check
// fails the contestant.

// fioState saves fio's random map in $RUN, so that the check replays
// exactly the blocks written, each with its offset and a crc32c.
const fioState = ` --filename="$FILE" --do_verify=0 --verify_state_save=1 --output-format=json`

// timed makes a fio job run for --fio-time.
const timed = ` --time_based --runtime="$FIOTIME"`

func randWrite(region string) string {
	return `cd "$RUN" && fio --name=randwrite --rw=randwrite --bs=4k --ioengine=psync --direct=1 --numjobs=4 --size=` + region +
		` --offset_increment=` + region + ` --group_reporting --randrepeat=1 --randseed=1601 --verify=crc32c`
}

const (
	cowJob   = `cd "$RUN" && fio --name=cow --rw=write --bs=64k --offset=1k --size=256m --offset_increment=256m --numjobs=4 --ioengine=psync --direct=1 --group_reporting --verify=crc32c`
	fsyncJob = `cd "$RUN" && fio --name=fsync --rw=randwrite --bs=4k --ioengine=psync --fsync=1 --numjobs=1 --size=8g --randrepeat=1 --randseed=1601 --verify=crc32c`
	// qemu-img bench writes what the fio job does: 16384 writes of
	// 64 KiB from 1 KiB on, each touching two clusters, copy-on-write of
	// nothing at both ends; at queue depth 64, host O_DIRECT.
	qemuImgBench = `qemu-img bench -w -t none -f qcow2 -c 16384 -d 64 -s 64k -o 1k --pattern=171 "$IMG"`
	// wchar prints what this shell's reaped children passed to write
	// system calls: the host bytes of a contestant without a daemon.
	wchar = `; echo "@wchar-cmd $(awk '/^wchar/ {print $2}' /proc/$$/io)"`
	// qemuImg sets I to qemu-img's arguments naming the image: with its
	// secret if it is encrypted.
	qemuImg = `I=("$IMG"); [ -z "$KEY" ] || I=(--object "secret,id=s0,file=$KEY" --image-opts "driver=qcow2,file.filename=$IMG,encrypt.key-secret=s0"); `
	// asRaw makes $F what qemu reads from the closed image, on the tmpfs.
	asRaw = qemuImg + `F="$IMG"; if [ "$FMT" != raw ]; then F="$OUT"; qemu-img convert -O raw "${I[@]}" "$F"; fi; `
)

// hostBytes is what the daemon (or the command, without one) wrote per
// byte written to the file: at most 1.1 means no zeros were written for
// the empty parts of copy-on-write clusters.
var hostBytes = metric{name: "host bytes per guest byte", unit: "x", lower: true, of: func(o *outcome) (float64, bool) {
	w, ok := o.vals["wchar"]
	if !ok {
		w, ok = o.vals["wchar-cmd"]
	}
	return w / (1 << 30), ok
}}

func writeWorkloads() []*workload {
	who, big := []string{"raw", "qcowfs", "qcowfs-devfuse", "qemu"}, []string{"raw", "qcowfs", "qemu", "qemu-tuned"}
	fioMetrics := []metric{iops, p99, val("worst latency", "ms", "max", 1e-6, true), cpuPerIO}
	ws := []*workload{
		{id: "w-randwrite-empty", title: "fio 4 KiB random writes, 4 jobs, O_DIRECT, into an empty 8 GiB image (every write allocates)",
			fresh: 8 << 30, who: who, cmd: randWrite("2g") + timed + fioState, parse: parseFio, verify: checked(fioReplay(randWrite("2g"))), metrics: fioMetrics},
		{id: "w-randwrite-full", title: "the same into a fully allocated 2 GiB image (overwrites)", fresh: 2 << 30, prealloc: true,
			who: who, cmd: randWrite("512m") + timed + fioState, parse: parseFio, verify: checked(fioReplay(randWrite("512m"))), metrics: fioMetrics},
		{id: "w-cow64k", title: "64 KiB writes at a 1 KiB offset, 1 GiB, 4 sequential writers, O_DIRECT, into an empty 8 GiB image", fresh: 8 << 30,
			who: []string{"raw", "qemu-img-bench", "qcowfs", "qemu"}, cmd: cowJob + fioState + wchar, parse: parseFio,
			own:    map[string]string{"qemu-img-bench": qemuImgBench + wchar},
			verify: checked(cowData), metrics: []metric{rate("MB/s", "", 1<<30), hostBytes}},
		{id: "w-seq1m", title: "dd bs=1M oflag=direct conv=fsync of 2 GiB of real files into an empty 8 GiB image", fresh: 8 << 30, image: "plain",
			who: big, prepare: func(e *env) error { _, err := e.sh(`cat "$W/raw/plain.raw" > /dev/null`, "W="+e.cfg.work); return err },
			cmd:     `dd if="$RAW" of="$FILE" bs=1M count=2048 iflag=fullblock oflag=direct conv=notrunc,fsync status=none`,
			verify:  checked(script(`qemu-img compare -q -f raw -F "$FMT" "$RAW" "$IMG"; echo "qemu-img compare: equal to the source"`)),
			metrics: []metric{rate("MB/s", "", 2<<30), cpuPerGiB}},
		{id: "w-fsync", title: "fio 4 KiB random writes, buffered, fsync after each, 1 job, into an empty 8 GiB image", fresh: 8 << 30,
			who: []string{"raw", "qcowfs", "qcowfs-devfuse", "qcowfs-nowb", "qemu"}, cmd: fsyncJob + timed + fioState, parse: parseFio, verify: checked(fioReplay(fsyncJob)),
			metrics: []metric{iops, val("fsync p99 latency", "ms", "sync-p99", 1e-6, true)}, quick: []string{"qcowfs", "qemu"}},
		{id: "w-guest", title: "a guest file system through a loop device: mkfs.ext4, untar 320 MiB, sync; rm 128 MiB, fstrim", fresh: 8 << 30,
			who: []string{"raw", "qcowfs", "qcowfs-nowb", "qemu", "qemu-tuned"}, prepare: treeTar, cmd: guestWrite, verify: checked(script(guestData)),
			metrics: []metric{took("mkfs + untar + sync", "build"), took("fstrim", "fstrim")}},
	}
	for _, w := range ws {
		w.group = "Writes"
	}
	return ws
}

// checked runs qemu-img check on the closed image after every run, and
// the data check after a contestant's first.
func checked(data func(e *env, t *target, o *outcome) error) func(e *env, t *target, o *outcome, round int) error {
	return func(e *env, t *target, o *outcome, round int) error {
		if !strings.HasSuffix(t.img, ".raw") {
			if _, err := e.sh(qemuImg+`qemu-img check -q "${I[@]}"`, t.vars...); err != nil {
				return fmt.Errorf("qemu-img check: %w", err)
			}
		}
		if round > 1 {
			return nil
		}
		return data(e, t, o)
	}
}

// script is a data check in bash; its last line of output is the note.
func script(s string) func(e *env, t *target, o *outcome) error {
	return func(e *env, t *target, o *outcome) error {
		out, err := e.sh(s, t.vars...)
		o.addNote(tail(out, 1))
		return err
	}
}

// fioReplay replays job in verify-only mode over what qemu reads from the
// closed image: it must read back as many blocks as were written, each
// with its own offset and a good checksum.
func fioReplay(job string) func(e *env, t *target, o *outcome) error {
	return func(e *env, t *target, o *outcome) error {
		out, err := e.sh(asRaw+job+
			` --filename="$F" --verify_only --verify_state_load=1 --verify_state_save=0 --direct=0 --output-format=json`, t.vars...)
		if err != nil {
			return err
		}
		j, err := decodeFio(out)
		if err != nil {
			return err
		}
		if j.Read.TotalIOs != o.vals["ios"] {
			return fmt.Errorf("fio --verify_only read back %.0f blocks, %.0f were written", j.Read.TotalIOs, o.vals["ios"])
		}
		o.addNote(fmt.Sprintf("all %.0f blocks read back through qemu with their offset and crc32c", j.Read.TotalIOs))
		return nil
	}
}

// cowData checks fio's blocks, or qemu-img bench's pattern over exactly
// the range written and zeros around it.
func cowData(e *env, t *target, o *outcome) error {
	if !strings.HasSuffix(t.dir, "qemu-img-bench") {
		return fioReplay(cowJob)(e, t, o)
	}
	out, err := e.sh(`qemu-io -r -f qcow2 -c "read -q -P 171 1k 1G" -c "read -q -P 0 0 1k" -c "read -q -P 0 $((1 << 30 | 1024)) 1023k" "$IMG"`, t.vars...)
	if err == nil && out != "" {
		err = fmt.Errorf("qemu-io: %s", tail(out, 2))
	}
	o.addNote("qemu-io: 1 GiB of the pattern from 1 KiB on, zeros around it")
	return err
}

// treeTar makes the guest's files once: 192 MiB from /usr/share, 128 MiB
// from /usr/lib (deleted before fstrim).
func treeTar(e *env) error {
	dst := filepath.Join(e.cfg.work, "src", "tree.tar")
	if exists(dst) {
		return nil
	}
	return e.atomically(dst, pick+`{ pick /usr/share 192; pick /usr/lib 128; } |
	tar -cf "$TAR" --no-unquote -T - --transform 's,^/\?usr/,,' 2>/dev/null`, "TAR")
}

const guestWrite = `dev=$(losetup -f --show "$FILE"); echo $dev > "$RUN/dev"; mkdir "$RUN/g"
lap build 'mkfs.ext4 -q -F $dev && mount -t ext4 $dev "$RUN/g" && tar -xf "$TREE" -C "$RUN/g" && sync -f "$RUN/g"'
rm -rf "$RUN/g/lib"; sync -f "$RUN/g"; before=$(du -m "$IMG" | cut -f1)
lap fstrim 'fstrim "$RUN/g"'
umount "$RUN/g"; losetup -d $dev
echo "# image file $before MiB before fstrim, $(du -m "$IMG" | cut -f1) MiB after"`

// guestData checks the file system qemu reads from the closed image.
const guestData = asRaw + `e2fsck -fn "$F" > /dev/null; mkdir "$RUN/c"; mount -t ext4 -o loop,ro,noload "$F" "$RUN/c"
trap 'umount "$RUN/c"' EXIT
tar -d -f "$TREE" -C "$RUN/c" share; test ! -e "$RUN/c/lib"
echo "e2fsck -fn clean, the files kept equal to the tar's"`
