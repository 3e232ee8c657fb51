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
// CLOCK_THREAD_CPUTIME_ID (nanoseconds). It changes what qemu's
// calibration measures, never what qemu writes or reads: the images are
// qemu's own, with an iteration count chosen from a truer clock.
const cpuClockC = `#define _GNU_SOURCE
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
		u->ru_utime.tv_sec = ts.tv_sec;
		u->ru_utime.tv_usec = ts.tv_nsec / 1000;
		u->ru_stime.tv_sec = 0;
		u->ru_stime.tv_usec = 0;
	}
	return r;
}
`

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
