#!/bin/bash
# The writeback-cache measurement of docs/benchmarks.md: run as root from the repository,
# with bin/qcowfs built; B= the binary to measure.
# writeback cache experiment: buffered small writes and a loop-mounted guest, with and without
set -e
B=${B:-bin/qcowfs}
W=/tmp/wbx; rm -rf $W; mkdir -p $W/src $W/mnt $W/g
one() { # mode i
  i=$2
  rm -f $W/src/*.qcow2; qemu-img create -q -f qcow2 $W/src/e.qcow2 4G
  if [ "$1" = wb ]; then $B mount --writable --writeback-cache $W/src $W/mnt; else $B mount --writable $W/src $W/mnt; fi
  r=$(fio --name=buf --filename=$W/mnt/e.raw --rw=randwrite --bs=4k --size=1G --io_size=256M --ioengine=psync --end_fsync=1 --numjobs=1 --output-format=terse --terse-version=3 | awk -F';' '{print $49" "$50}')  # write bw KiB/s, iops
  s=$( { /usr/bin/time -f %e dd if=/dev/zero of=$W/mnt/e.raw bs=512 count=200000 seek=3000000 conv=notrunc,fsync status=none; } 2>&1 )
  dev=$(losetup -f --show $W/mnt/e.raw)
  t0=$(date +%s.%N)
  mkfs.ext4 -q -E nodiscard $dev >/dev/null 2>&1; mount $dev $W/g; tar -C /usr/share -cf - doc locale 2>/dev/null | tar -C $W/g -xf -; sync; umount $W/g
  t1=$(date +%s.%N)
  losetup -d $dev
  $B unmount $W/mnt
  qemu-img check -q $W/src/e.qcow2 || echo CHECK FAILED
  echo "$1 run$i fio-buffered-4k-randwrite(bw KiB/s, iops)=$r dd-512B-fsync=${s}s guest-mkfs+untar+sync=$(echo "$t1 - $t0" | bc)s"
}
for i in 1 2 3; do one plain $i; one wb $i; done
