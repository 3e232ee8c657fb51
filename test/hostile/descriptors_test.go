package hostile

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// mountLimited mounts src with the daemon started under prlimit
// --nofile=soft:hard.
func mountLimited(t *testing.T, src string, soft, hard int) *harness.Mounted {
	t.Helper()
	qemu.Require(t, "prlimit")
	return harness.Daemon{Wrap: []string{"prlimit", fmt.Sprintf("--nofile=%d:%d", soft, hard)}}.Mount(t, src)
}

// nofile returns the soft and hard RLIMIT_NOFILE of process pid.
func nofile(t *testing.T, pid int) (soft, hard string) {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/limits", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "Max open files") {
			f := strings.Fields(line)
			return f[3], f[4]
		}
	}
	t.Fatalf("no open file limit in /proc/%d/limits", pid)
	return "", ""
}

// TestHostileDescriptorLimit: started with a soft descriptor limit below
// its hard one, the daemon runs with the hard one less one (the Go
// runtime raises it so at start, syscall/rlimit.go), and says so in its
// log.
func TestHostileDescriptorLimit(t *testing.T) {
	src := qemu.TempDir(t)
	qemu.Create(t, "qcow2", filepath.Join(src, "a.qcow2"), "1M")
	m := mountLimited(t, src, 256, 4096)
	if soft, hard := nofile(t, m.PID(t)); soft != "4095" || hard != "4096" {
		t.Errorf("the daemon's open file limit is %s (hard %s); started with 256:4096", soft, hard)
	}
	if log := m.LogText(t); !strings.Contains(log, "msg=\"file descriptors\" limit=4095") {
		t.Errorf("the log does not give the limit:\n%s", log)
	}
}

// TestHostileDescriptorBudget: a daemon with 512 descriptors. A folder
// whose 150 images are all opened at once gets what the budget gives one
// folder (EMFILE for the rest, one log line); meanwhile the images of
// another folder open, a plain file opens, listings work, and the daemon
// never holds more than its limit. Once the files are closed, it holds
// none of them.
func TestHostileDescriptorBudget(t *testing.T) {
	src := qemu.TempDir(t)
	b := filepath.Join(src, "b")
	copies(t, filepath.Join(src, "a"), 150)
	copies(t, b, 5)
	os.WriteFile(filepath.Join(b, "notes.txt"), []byte("plain"), 0o644)
	m := mountLimited(t, src, 512, 512)
	pid := m.PID(t)
	listWithin(t, filepath.Join(m.Dir, "a"), 30*time.Second)
	listWithin(t, filepath.Join(m.Dir, "b"), 30*time.Second)
	base := harness.ReadProc(t, pid)

	var held []*os.File
	defer func() {
		for _, f := range held {
			f.Close()
		}
	}()
	opened, refused := 0, 0
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i := 0; i < 150; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f, err := os.Open(filepath.Join(m.Dir, "a", fmt.Sprintf("img-%05d.raw", i)))
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				opened++
				held = append(held, f)
			case errIs(err, syscall.EMFILE):
				refused++
			default:
				t.Errorf("opening image %d: %v", i, err)
			}
		}()
	}
	harness.Within(t, "opening 150 images", 60*time.Second, func() (int, error) { wg.Wait(); return 0, nil })
	during := harness.ReadProc(t, pid)
	t.Logf("folder a: %d opened, %d refused (EMFILE); daemon %v (before %v)", opened, refused, during, base)
	if refused == 0 || opened == 0 {
		t.Errorf("%d opened, %d refused: the budget did not hold (or let nothing in)", opened, refused)
	}
	if during.FDs > 512 {
		t.Errorf("the daemon holds %d descriptors, its limit is 512", during.FDs)
	}
	// Everything else still works.
	for i := 0; i < 5; i++ {
		f, err := os.Open(filepath.Join(m.Dir, "b", fmt.Sprintf("img-%05d.raw", i)))
		if err != nil {
			t.Errorf("folder b starves: %v", err)
			continue
		}
		buf := make([]byte, 4096)
		if _, err := f.ReadAt(buf, 0); err != nil || buf[0] != 0x31 {
			t.Errorf("reading an image of folder b: %v", err)
		}
		f.Close()
	}
	if txt, err := os.ReadFile(filepath.Join(m.Dir, "b", "notes.txt")); err != nil || string(txt) != "plain" {
		t.Errorf("a plain file: %q, %v", txt, err)
	}
	listWithin(t, m.Dir, 30*time.Second)
	if log := m.LogText(t); !strings.Contains(log, "too many open images") {
		t.Errorf("no log line about the budget:\n%s", log)
	}
	for _, f := range held {
		f.Close()
	}
	held = nil
	harness.WaitFor(t, "the daemon to close the images", 30*time.Second, func() bool { return harness.ReadProc(t, pid).Files <= base.Files })
	m.NoPanics(t)
}

// TestHostileManyImagesDescriptors: 21,000 images in a folder, more than
// the daemon's descriptor limit (20,000 here, whatever the machine's
// hard limit: prlimit sets it). A listing with a stat of every name works,
// the daemon's descriptors stay few all along, and afterwards a plain file
// and an image of the folder open.
func TestHostileManyImagesDescriptors(t *testing.T) {
	src := qemu.TempDir(t)
	dir := filepath.Join(src, "lots")
	const n = 21000
	copies(t, dir, n)
	os.WriteFile(filepath.Join(dir, "notes.txt"), []byte("plain"), 0o644)
	m := mountLimited(t, src, 20000, 20000)
	pid := m.PID(t)
	base := harness.ReadProc(t, pid)
	// Sample the daemon's descriptors while it lists.
	stop := make(chan struct{})
	peak := make(chan int)
	go func() {
		most := 0
		for {
			select {
			case <-stop:
				peak <- most
				return
			case <-time.After(20 * time.Millisecond):
				fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
				most = max(most, len(fds))
			}
		}
	}()
	start := time.Now()
	listed := listWithin(t, filepath.Join(m.Dir, "lots"), 300*time.Second)
	statAll(t, filepath.Join(m.Dir, "lots"), listed, 300*time.Second)
	close(stop)
	most := <-peak
	t.Logf("%d images: listing with stats %v; daemon descriptors %d before, at most %d during; %v", n,
		time.Since(start).Round(time.Millisecond), base.FDs, most, harness.ReadProc(t, pid))
	if len(listed) != n+1 {
		t.Errorf("%d names listed, want %d", len(listed), n+1)
	}
	if most > base.FDs+64 {
		t.Errorf("the daemon held up to %d descriptors while listing (%d before)", most, base.FDs)
	}
	peakWithin(t, pid, 160)
	if txt, err := os.ReadFile(filepath.Join(m.Dir, "lots", "notes.txt")); err != nil || string(txt) != "plain" {
		t.Errorf("a plain file: %q, %v", txt, err)
	}
	if b, err := probeImage(t, filepath.Join(m.Dir, "lots", "img-20999.raw")); err != nil || b[0] != 0x31 {
		t.Errorf("an image of the folder: %v", err)
	}
	m.NoPanics(t)
}

// TestHostileManyImages: 2,000 images in a folder. A listing with a stat
// of every name is one scan; the second reads no image again.
func TestHostileManyImages(t *testing.T) {
	src := harness.SourceDir(t)
	copies(t, filepath.Join(src, "lots"), 2000)
	m := harness.Mount(t, src)
	pid := m.PID(t)
	p0 := harness.ReadProc(t, pid)
	start := time.Now()
	listed := listWithin(t, filepath.Join(m.Dir, "lots"), 120*time.Second)
	statAll(t, filepath.Join(m.Dir, "lots"), listed, 120*time.Second)
	p1 := harness.ReadProc(t, pid)
	first := time.Since(start)
	start = time.Now()
	statAll(t, filepath.Join(m.Dir, "lots"), listWithin(t, filepath.Join(m.Dir, "lots"), 120*time.Second), 120*time.Second)
	p2 := harness.ReadProc(t, pid)
	t.Logf("2,000 images: first listing with stats %v, %d KiB read; second %v, %d KiB read", first.Round(time.Millisecond),
		(p1.Rchar-p0.Rchar)>>10, time.Since(start).Round(time.Millisecond), (p2.Rchar-p1.Rchar)>>10)
	if len(listed) != 2000 {
		t.Errorf("%d names listed", len(listed))
	}
	if p2.Rchar-p1.Rchar > (p1.Rchar-p0.Rchar)/4 {
		t.Errorf("the second listing read %d bytes, the first %d", p2.Rchar-p1.Rchar, p1.Rchar-p0.Rchar)
	}
}

// copies makes the folder dir with n copies of one small image (1 MiB of
// 512-byte clusters, 4 KiB of 0x31 at 0), as img-00000.qcow2, ...
func copies(t testing.TB, dir string, n int) {
	t.Helper()
	tmpl := filepath.Join(t.TempDir(), "t.qcow2")
	qemu.Create(t, "qcow2", tmpl, "1M", "-o", "cluster_size=512")
	qemu.IO(t, tmpl, "write -P 0x31 0 4k")
	b, err := os.ReadFile(tmpl)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < n; i++ {
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("img-%05d.qcow2", i)), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}
