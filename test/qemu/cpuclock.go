package qemu

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
)

// qemu-img chooses an encrypted image's PBKDF2 iteration count by timing
// PBKDF2 on its thread's CPU clock, read with getrusage(RUSAGE_THREAD).
// Where the kernel counts a thread's time in scheduler ticks (4 ms on this
// VM), the first timing often reads 0 ms and qemu-img gives up ("Unable
// to get accurate CPU usage"): a fifth of the creations at a load of 2,
// ten in a row under a full test run. The tools the tests start therefore
// get, through LD_PRELOAD, a getrusage that answers RUSAGE_THREAD from
// CLOCK_THREAD_CPUTIME_ID (nanoseconds).
//
// That clock also runs cpuClockScale times fast. qemu-img's calibration
// runs PBKDF2 with more and more iterations until one run takes 500 ms,
// twice per image (the master key digest, the key slot), whatever the
// iter-time: over 2 s of CPU per encrypted image created, most of the
// time of the tests that make the encrypted matrix. On the faster clock
// it does a fifth of that work (0.4 s), and qemu writes iteration counts
// a fifth of those it would have chosen: with iter-time=10 on this
// machine, the key slot's 1,300 (ripemd160) to 10,000 (sha256) instead
// of 6,700 to 50,000, and the master key digest's mostly qemu's minimum,
// 1,000, instead of 3,400 to 12,500 (the two still differ). The images
// are otherwise qemu's own, made, read and written by qemu as ever;
// opening them (qemu, and qcowfs's PBKDF2) is faster too.
const cpuClockC = `#define _GNU_SOURCE
#define SCALE ` + cpuClockScale + `
#include <dlfcn.h>
#include <sys/resource.h>
#include <time.h>

int getrusage(int who, struct rusage *u) {
	static int (*real)(int, struct rusage *);
	if (!real)
		real = (int (*)(int, struct rusage *))dlsym(RTLD_NEXT, "getrusage");
	int r = real(who, u);
	struct timespec ts;
	if (r == 0 && who == RUSAGE_THREAD && clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0) {
		long long us = ((long long)ts.tv_sec * 1000000 + ts.tv_nsec / 1000) * SCALE;
		u->ru_utime.tv_sec = us / 1000000;
		u->ru_utime.tv_usec = us % 1000000;
		u->ru_stime.tv_sec = 0;
		u->ru_stime.tv_usec = 0;
	}
	return r;
}
`

// cpuClockScale is how many times fast the shim's thread CPU clock runs.
const cpuClockScale = "5"

var cpuClockOnce sync.Once

// preloadCPUClock builds the getrusage shim with gcc (once per test
// process) and puts it in LD_PRELOAD for every command started after. It
// fails the caller under CI=true when it cannot (gcc is one of CI's
// packages); elsewhere the retries in Run stand in for it.
func preloadCPUClock() (err error) {
	cpuClockOnce.Do(func() {
		dir, e := os.MkdirTemp("", "qcowfs-cpuclock-")
		if e != nil {
			err = e
			return
		}
		src, so := filepath.Join(dir, "cpuclock.c"), filepath.Join(dir, "cpuclock.so")
		if e := os.WriteFile(src, []byte(cpuClockC), 0o644); e != nil {
			err = e
			return
		}
		if out, e := exec.Command("gcc", "-shared", "-fPIC", "-O2", "-o", so, src, "-ldl").CombinedOutput(); e != nil {
			err = fmt.Errorf("gcc, building the getrusage shim for qemu-img: %v: %s", e, out)
			return
		}
		os.Setenv("LD_PRELOAD", so)
	})
	return err
}
