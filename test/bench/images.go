package main

import (
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// An image is a qcow2 test image and its raw twin (the same bytes as a raw
// file: the raw file baseline reads it, copies are compared with it). Each
// lives alone in WORK/img/NAME/, so that a mount of the folder shows just
// it; twins are in WORK/raw. Both are built once and kept.
type image struct {
	name  string
	title string // for the report
	twin  string // the raw twin's name: its own, or the image it was compressed from
	// raw makes the twin $RAW first, for images made from it; without
	// it the twin is converted from the image.
	raw string
	// make makes the image $DST (bash; $RAW is the twin).
	make string
}

// pick lists the regular files under $1 in name order, skipping those
// that no longer fit, until $2 MiB: real files, so that compression and
// file sizes are those of real disks.
const pick = `pick() { find "$1" -xdev -type f -readable -printf '%s\t%p\n' 2>/dev/null | LC_ALL=C sort -t$'\t' -k2 |
	awk -F'\t' -v max=$(($2 << 20)) '$1 <= max - s { s += $1; print $2 }'; }
`

// qemuIO runs the qemu-io commands that a loop prints on an image it creates.
func qemuIO(create, loop string) string {
	return "qemu-img create -q -f qcow2 " + create + "\n" + loop + ` | qemu-io -t unsafe -f qcow2 "$DST" > /dev/null`
}

var images = []*image{
	{name: "plain", title: "2 GiB of real files (a tar of /usr), every cluster allocated",
		raw: `for i in 1 2 3 4; do tar -cf - --sort=name /usr 2>/dev/null || true; done | head -c 2G > "$RAW"
[ "$(stat -c %s "$RAW")" = $((2 << 30)) ]`,
		make: `qemu-img convert -q -S 0 -f raw -O qcow2 "$RAW" "$DST"`},
	{name: "deflate", twin: "plain", title: "the plain image compressed with deflate (`qemu-img convert -c`)",
		make: `qemu-img convert -q -W -m 4 -c -f raw -O qcow2 "$RAW" "$DST"`},
	{name: "zstd", twin: "plain", title: "the plain image compressed with zstd",
		make: `qemu-img convert -q -W -m 4 -c -o compression_type=zstd -f raw -O qcow2 "$RAW" "$DST"`},
	{name: "enc", twin: "plain", title: "the plain image encrypted: LUKS, AES-256-XTS plain64, qemu's default PBKDF2 cost",
		make: `luks qemu-img convert -q -S 0 --object secret,id=s0,file="$KEY" -o encrypt.format=luks,encrypt.key-secret=s0,encrypt.cipher-alg=aes-256,encrypt.cipher-mode=xts -f raw -O qcow2 "$RAW" "$DST"`},
	{name: "rawfile", twin: "plain", title: "the plain image's raw twin as a plain file (plain.img, a hard link) beside an empty qcow2 image",
		make: `qemu-img create -q -f qcow2 "$DST" 1M && ln -f "$RAW" "${DST%/*}/plain.img"`},
	{name: "sparse1t", title: "1 TiB, 256 MiB of data in 1 MiB pieces, one every 4 GiB",
		make: qemuIO(`"$DST" 1T`, `for i in $(seq 0 255); do echo "write -q -P $((i % 255 + 1)) $((i * 4 * 2**30 + (i * 131 % 4000) * 2**20)) 1M"; done`)},
	{name: "fragback", title: "1 GiB written backwards 64 KiB at a time (host clusters in reverse order)",
		make: qemuIO(`"$DST" 1G`, `for i in $(seq 16383 -1 0); do echo "write -q -P $((i % 255 + 1)) $((i * 65536)) 64k"; done`)},
	{name: "fragfwd", title: "1 GiB written forwards in two interleaved passes (even 64 KiB chunks, then odd)",
		make: qemuIO(`"$DST" 1G`, `for i in $(seq 0 2 16383) $(seq 1 2 16383); do echo "write -q -P $((i % 255 + 1)) $((i * 65536)) 64k"; done`)},
	{name: "prealloc", title: "1 GiB preallocation=metadata, 6 MiB of data",
		make: qemuIO(`-o preallocation=metadata "$DST" 1G`, `printf 'write -q -P 90 0 4M\nwrite -q -P 91 300M 1M\nwrite -q -P 92 1023M 1M\n'`)},
	{name: "chain1", title: "a 1 GiB disk of one image, every 64 KiB cluster written", make: chain(1, 1<<30, 16384)},
	{name: "chain16", title: "the same 1 GiB spread over a backing chain of 16 images, each holding every 16th cluster", make: chain(16, 1<<30, 16384)},
	{name: "chain64", title: "the same over 64 images, each holding every 64th cluster", make: chain(64, 1<<30, 16384)},
	{name: "chain64t", title: "a 1 TiB disk over 64 images, 256 MiB of data, each image's clusters spread over the whole disk", make: chain(64, 1<<40, 4096)},
	{name: "guest", title: "a GPT disk, one ext4 partition at 1 MiB with 384 MiB of files from /usr",
		raw: pick + `st="$RAW.tree"; rm -rf "$st" "$RAW.part"; mkdir "$st"
{ pick /usr/share 256; pick /usr/lib 128; } | tar -cf - --no-unquote -T - 2>/dev/null | tar -xf - -C "$st"
mkfs.ext4 -q -F -d "$st" -L guest "$RAW.part" $(( $(du -sm "$st" | cut -f1) * 13 / 10 + 128 ))M
truncate -s $(( $(stat -c %s "$RAW.part") + (2 << 20) )) "$RAW"
echo "label: gpt
start=2048, size=$(( $(stat -c %s "$RAW.part") / 512 )), type=linux" | sfdisk -q "$RAW"
dd if="$RAW.part" of="$RAW" bs=1M seek=1 conv=notrunc,sparse status=none
rm -rf "$st" "$RAW.part"`,
		make: `qemu-img convert -q -f raw -O qcow2 "$RAW" "$DST"`},
}

func imageNamed(name string) *image {
	for _, im := range images {
		if im.name == name {
			return im
		}
	}
	panic("bench: no image " + name)
}

// twinOf is the name of an image's raw twin.
func twinOf(name string) string {
	if t := imageNamed(name).twin; t != "" {
		return t
	}
	return name
}

// build makes the image name and its twin if they are missing; each file
// is made under a temporary name and renamed, so a file there is whole.
func (e *env) build(name string) error {
	im := imageNamed(name)
	dst := filepath.Join(e.cfg.work, "img", name, name+".qcow2")
	raw := filepath.Join(e.cfg.work, "raw", twinOf(name)+".raw")
	if exists(dst) && exists(raw) {
		return nil
	}
	if im.twin != "" {
		if err := e.build(im.twin); err != nil {
			return err
		}
	}
	start := time.Now()
	fmt.Printf("building image %s (once; kept in %s)\n", name, e.cfg.work)
	if im.raw != "" && !exists(raw) {
		if err := e.atomically(raw, im.raw, "RAW"); err != nil {
			return err
		}
	}
	if err := e.atomically(dst, im.make, "DST", "RAW="+raw, "KEY="+e.key()); err != nil {
		return err
	}
	if !exists(raw) {
		if err := e.atomically(raw, `qemu-img convert -q -f qcow2 -O raw "$DST" "$RAW"`, "RAW", "DST="+dst); err != nil {
			return err
		}
	}
	fmt.Printf("  %s: %s\n", name, time.Since(start).Round(time.Second))
	return nil
}

// atomically runs script with $name set to a temporary path next to dst,
// and renames that to dst.
func (e *env) atomically(dst, script, name string, vars ...string) error {
	tmp := dst + ".building"
	os.Remove(tmp)
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	x := e.run(job{script: script, vars: append(vars, name+"="+tmp), limit: time.Hour})
	if x.err != nil {
		os.Remove(tmp)
		return fmt.Errorf("building %s: %w", dst, x.err)
	}
	return os.Rename(tmp, dst)
}

// key is the passphrase file of the encrypted images (made once, 0600):
// qemu reads it as a secret's file=, qcowfs as --key-file.
func (e *env) key() string {
	p := filepath.Join(e.cfg.work, "secret.key")
	if !exists(p) {
		os.WriteFile(p, []byte("qcowfs bench passphrase"), 0o600)
	}
	return p
}

func exists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// chain makes a backing chain of depth images of size bytes: the top is
// $DST, the others are in the layers folder beside it (l00.qcow2 the
// base), so that a mount of the image's folder shows the top alone (and
// does no work for the layers until that folder is listed). n clusters of
// 64 KiB are spread evenly over the disk: cluster i is written, with its
// own byte, in layer i%depth, so every layer holds 1/depth of them and a
// read walks half the chain on average.
func chain(depth int, size int64, n int) string {
	return fmt.Sprintf(`d=%d n=%d size=%d dir=$(dirname "$DST"); prev=; step=$(( size / 65536 / n ))
rm -rf "$dir/layers"; mkdir "$dir/layers"
for k in $(seq 0 $((d - 1))); do
  f="$dir/layers/l$(printf %%02d $k).qcow2" b=$(basename "$prev"); [ $k = $((d - 1)) ] && f="$DST" b="layers/$b"
  if [ -z "$prev" ]; then qemu-img create -q -f qcow2 "$f" $size; else qemu-img create -q -f qcow2 -b "$b" -F qcow2 "$f" $size; fi
  for i in $(seq $k $d $((n - 1))); do echo "write -q -P $((i %% 255 + 1)) $((i * step * 65536)) 64k"; done | qemu-io -t unsafe -f qcow2 "$f" > /dev/null
  prev=$f
done`, depth, n, size)
}
