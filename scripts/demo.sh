#!/usr/bin/env bash
# make demo [IMAGES=folder]: mount a folder of qcow2 images with qcowfs and
# show what it does. Without IMAGES, a few sample images are made with
# qemu-img first. Everything is cleaned up at the end, even on failure.
set -euo pipefail
bin=$(realpath "$1")
images=${2:-}
work=$(mktemp -d "${TMPDIR:-/tmp}/qcowfs-demo.XXXXXX")
mnt=$work/mnt
mkdir -p "$mnt"
cleanup() {
  if mountpoint -q "$mnt"; then "$bin" unmount "$mnt" || umount -l "$mnt"; fi
  if [ -n "${omnt:-}" ] && mountpoint -q "$omnt"; then "$bin" unmount "$omnt" || umount -l "$omnt"; fi
  rm -rf "$work"
}
trap cleanup EXIT
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
run() { printf '$ %s\n' "$*"; "$@"; }

if [ -z "$images" ]; then
  images=$work/images
  mkdir -p "$images/templates"
  say "Making sample images with qemu-img"
  # A 4 GiB disk with a little data at both ends: mostly holes.
  run qemu-img create -q -f qcow2 "$images/vm.qcow2" 4G
  run qemu-io -f qcow2 -c "write -P 0xaa 0 8M" -c "write -P 0xbb 3G 2M" "$images/vm.qcow2" >/dev/null
  # A compressed image of real files (an ext4 file system made from
  # /usr/share/doc), as cloud templates are shipped.
  size=$(( $(du -sm /usr/share/doc | cut -f1) * 2 + 64 ))M
  run mkfs.ext4 -q -F -d /usr/share/doc "$work/doc.raw" "$size"
  run qemu-img convert -c -O qcow2 "$work/doc.raw" "$images/templates/docs.qcow2"
  # A backing chain: an overlay over that template, larger than it.
  run qemu-img create -q -f qcow2 -b docs.qcow2 -F qcow2 "$images/templates/docs-overlay.qcow2" 512M
  run qemu-io -f qcow2 -c "write -P 0xcc 300M 1M" "$images/templates/docs-overlay.qcow2" >/dev/null
  echo "notes about these images" > "$images/README.txt"
fi

say "Mounting $images on $mnt"
run "$bin" mount --log-file "$work/qcowfs.log" "$images" "$mnt"
run ls -lR "$mnt"

# The image to show off: the sample vm.qcow2, or the first image found.
src=$images/vm.qcow2
if [ ! -f "$src" ]; then
  src=$(find "$images" -type f -exec sh -c 'head -c 4 "$1" | grep -q "^QFI" && echo "$1"' _ {} \; | sort | head -n 1)
fi
[ -n "$src" ] || { echo "no qcow2 image found under $images"; exit 1; }
# Its name in the mount, by the naming rule (README.md).
rel=${src#"$images"/}
case "$rel" in
  *.qcow2|*.QCOW2) raw=$mnt/${rel%.*}.raw ;;
  *.qcow|*.QCOW|*.img|*.IMG) raw=$mnt/${rel%.*}.raw ;;
  *) raw=$mnt/$rel.raw ;;
esac

say "Image details, as qemu-img info would print them"
run "$bin" info "$src"

say "A sparse copy out of the mount"
run cp --sparse=always "$raw" "$work/copy.raw"
run du -h --apparent-size "$work/copy.raw"
run du -h "$work/copy.raw"

say "Checking the copy against qemu-img convert -O raw"
run qemu-img convert -O raw "$src" "$work/qemu.raw"
run cmp "$work/copy.raw" "$work/qemu.raw" && echo "identical"

say "The daemon's log"
run cat "$work/qcowfs.log"

say "Unmounting"
run "$bin" unmount "$mnt"

say "Writing without touching the original: an overlay"
omnt=$work/omnt
mkdir -p "$omnt"
before=$(sha256sum "$src" | cut -d' ' -f1)
run "$bin" mount --writable --overlay "$work/overlays" --log-file "$work/qcowfs-overlay.log" "$images" "$omnt"
orel=${raw#"$mnt"/}
run dd if=/dev/urandom of="$omnt/$orel" bs=64k count=16 seek=100 conv=notrunc,fsync status=none
run "$bin" unmount "$omnt"
after=$(sha256sum "$src" | cut -d' ' -f1)
[ "$before" = "$after" ] && echo "the original is unchanged (sha256 $after)"
overlay=$work/overlays/${src#"$images"/}
run qemu-img info "$overlay"
run qemu-img check "$overlay"
