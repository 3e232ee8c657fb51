#!/usr/bin/env bash
# Issue 47's spike: qcowfs over /dev/fuse against qcowfs over FUSE over
# io_uring, interleaved in one run. As root. Usage:
#   scripts/uring-spike.sh BIN [ROUNDS] [FIOTIME]
# A 1 GiB fully allocated qcow2 image (qemu-img convert -S 0 of random
# bytes), its file read into the page cache before every run; each run
# mounts anew. fio: 4 KiB O_DIRECT random reads, psync, 4 jobs; dd: bs=1M
# of the whole raw file, the mount's cache empty. Daemon CPU is utime +
# stime of /proc/PID/stat around the command; per read for fio (fio's
# total_ios), per GiB for dd. Every line has the load averages of
# uptime at its start: the machine is shared. The order of the
# contestants rotates every round. enable_uring is set to Y for the run
# and put back as it was.
set -euo pipefail
BIN=$(realpath "${1:?usage: $0 BIN [ROUNDS] [FIOTIME]}")
ROUNDS=${2:-5}
FIOTIME=${3:-10}
W=${QCOWFS_SPIKE_WORK:-/var/tmp/qcowfs-uring-spike}
PARAM=/sys/module/fuse/parameters/enable_uring
mkdir -p "$W/img" "$W/mnt"
if [ ! -f "$W/img/vm.qcow2" ]; then
  head -c 1G /dev/urandom > "$W/vm.raw"
  qemu-img convert -q -S 0 -f raw -O qcow2 "$W/vm.raw" "$W/img/vm.qcow2"
  rm "$W/vm.raw"
fi
prev=$(cat $PARAM)
trap 'echo "$prev" > $PARAM; fusermount3 -u -z "$W/mnt" 2>/dev/null || true' EXIT
echo Y > $PARAM
tick=$(getconf CLK_TCK)
cpu() { awk -v t="$tick" '{print ($14 + $15) / t}' /proc/$1/stat; }
declare -A FLAGS=([ring]="--io-uring=on" [classic]="--io-uring=off" [classic-copy]="--io-uring=off --read-path=copy")
WHO=(classic ring classic-copy)
echo "# $(date -u +%FT%TZ) $(uname -r) nproc=$(nproc) $("$BIN" version | head -1)"
echo "round contestant workload value unit cpu_us_per_op cpu_s load1 load5 load15"
for r in $(seq "$ROUNDS"); do
  for i in "${!WHO[@]}"; do
    c=${WHO[$(( (i + r - 1) % ${#WHO[@]} ))]}
    for wl in fio dd; do
      cat "$W/img/vm.qcow2" > /dev/null
      "$BIN" mount ${FLAGS[$c]} --log-file "$W/$c.log" "$W/img" "$W/mnt"
      pid=$(pgrep -f -- "--log-file $W/$c.log" | head -1)
      read -r l1 l5 l15 _ < /proc/loadavg
      c0=$(cpu $pid)
      if [ $wl = fio ]; then
        out=$(fio --name=r --filename="$W/mnt/vm.raw" --readonly --rw=randread --bs=4k --ioengine=psync --direct=1 --numjobs=4 --group_reporting --time_based --runtime="$FIOTIME" --randrepeat=0 --norandommap --output-format=json)
        c1=$(cpu $pid)
        read -r iops ios < <(echo "$out" | python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]["read"]; print(j["iops"], j["total_ios"])')
        echo "$r $c fio4k $(printf %.0f $iops) IOPS $(awk -v a=$c0 -v b=$c1 -v n=$ios 'BEGIN{printf "%.2f", (b-a)/n*1e6}') $(awk -v a=$c0 -v b=$c1 'BEGIN{print b-a}') $l1 $l5 $l15"
      else
        t0=$(date +%s.%N)
        dd if="$W/mnt/vm.raw" of=/dev/null bs=1M status=none
        t1=$(date +%s.%N); c1=$(cpu $pid)
        echo "$r $c dd1M $(awk -v a=$t0 -v b=$t1 'BEGIN{printf "%.0f", 1024/(b-a)}') MiB/s $(awk -v a=$c0 -v b=$c1 'BEGIN{printf "%.0f", (b-a)*1e6}')perGiB $(awk -v a=$c0 -v b=$c1 'BEGIN{print b-a}') $l1 $l5 $l15"
      fi
      "$BIN" unmount "$W/mnt"
      while kill -0 $pid 2>/dev/null; do sleep 0.1; done
    done
  done
done
