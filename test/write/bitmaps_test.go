package write

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// Persistent dirty bitmaps through writable mounts (issue 36), with qemu
// as the oracle: what qemu-nbd -B says each bitmap holds after the mount
// is what the writes, discards and zero-writes touched, rounded out to the
// bitmap's granularity (a model that starts from qemu's own answer before
// the mount); qcowfs map --bitmap prints what qemu-img map prints over
// qemu-nbd; the changed-blocks view, laid over a full copy taken before
// the writes with the README's recipe, is the disk.

// granules is a model of a bitmap: the dirty granules of granularity gran.
type granules struct {
	gran int64
	set  map[int64]bool
}

func newGranules(gran int64, dirty [][2]int64) *granules {
	g := &granules{gran: gran, set: map[int64]bool{}}
	for _, r := range dirty {
		g.add(r[0], r[1]-r[0])
	}
	return g
}

// add marks the granules of [off, off+n).
func (g *granules) add(off, n int64) {
	for i := off / g.gran; n > 0 && i <= (off+n-1)/g.gran; i++ {
		g.set[i] = true
	}
}

// ranges are the dirty granules as merged [start, end) ranges of a disk
// of size bytes.
func (g *granules) ranges(size int64) [][2]int64 {
	keys := make([]int64, 0, len(g.set))
	for k := range g.set {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var out [][2]int64
	for _, k := range keys {
		s, e := k*g.gran, min((k+1)*g.gran, size)
		if s >= size {
			continue
		}
		if n := len(out); n > 0 && out[n-1][1] == s {
			out[n-1][1] = e
			continue
		}
		out = append(out, [2]int64{s, e})
	}
	return out
}

func bytesIn(ranges [][2]int64) int64 {
	var n int64
	for _, r := range ranges {
		n += r[1] - r[0]
	}
	return n
}

// bitmapImage makes vm.qcow2 in dir, 64 MiB, with bitmaps b64k (64 KiB)
// and b1m (1 MiB), enabled, and off (64 KiB), disabled after qemu-io's
// writes, which all three record; snap adds an internal snapshot. It
// returns the image and the granularities.
func bitmapImage(t *testing.T, dir string, snap bool) (string, map[string]int64) {
	p := filepath.Join(dir, "vm.qcow2")
	qemu.Create(t, "qcow2", p, "64M")
	gran := map[string]int64{"b64k": 64 << 10, "b1m": 1 << 20, "off": 64 << 10}
	for _, name := range []string{"b64k", "b1m", "off"} {
		qemu.Img(t, "bitmap", "--add", "-g", fmt.Sprint(gran[name]), p, name)
	}
	qemu.IO(t, p, "write -P 1 100k 10k", "write -P 2 3M 1M", "write -P 3 40M 4k")
	qemu.Img(t, "bitmap", "--disable", p, "off")
	if snap {
		qemu.Img(t, "snapshot", "-c", "s1", p)
	}
	return p, gran
}

// recipe returns the README's incremental-backup recipe: the shell block
// that lays a bitmap's view ($VIEW) over a copy ($OUT), without its first
// line, which sets the two.
func recipe(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(harness.Root(t), "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, block := range strings.Split(string(b), "```sh\n")[1:] {
		block, _, _ = strings.Cut(block, "```")
		if first, rest, ok := strings.Cut(block, "\n"); ok && strings.HasPrefix(first, "VIEW=") {
			return rest
		}
	}
	t.Fatal("README.md has no ```sh block starting with VIEW= (the incremental-backup recipe)")
	return ""
}

// runRecipe runs the recipe with VIEW and OUT, and qcowfs on the PATH.
func runRecipe(t *testing.T, view, out string) {
	t.Helper()
	cmd := exec.Command("bash", "-e", "-o", "pipefail", "-c", recipe(t))
	cmd.Env = append(os.Environ(), "VIEW="+view, "OUT="+out, "PATH="+filepath.Dir(harness.Bin())+":"+os.Getenv("PATH"))
	harness.WantOK(t, "the README's recipe", harness.RunCmd(t, cmd))
}

// sameBitmapMap compares qcowfs map --bitmap with qemu-img map through
// qemu-nbd -B, human and JSON, the export's name replaced by the image's.
func sameBitmapMap(t *testing.T, image, name string) {
	t.Helper()
	opts, stop := qemu.ServeBitmap(t, image, name)
	defer stop()
	for _, form := range [][]string{nil, {"--output=json"}} {
		q := harness.Exec(t, "qemu-img", append(append([]string{"map"}, form...), "--image-opts", opts)...)
		q.Stdout = strings.ReplaceAll(q.Stdout, qemu.NBDFile(opts), image)
		us := harness.Run(t, append(append([]string{"map", "--bitmap", name}, form...), image)...)
		harness.SameAsQemu(t, fmt.Sprintf("qcowfs map --bitmap %s %v", name, form), q, us)
	}
}

// TestBitmapsThroughMount: an image with two enabled bitmaps (64 KiB and
// 1 MiB) and a disabled one, with and without an internal snapshot, with
// and without the writeback cache, is written through a writable mount:
// pwrite, fallocate punch-hole and zero-range, ftruncate (a grow), and
// blkdiscard on a loop device over the raw file. While mounted, the views'
// SEEK_DATA/SEEK_HOLE and st_blocks are the model's; the README's recipe
// lays a view over the full copy taken before the writes. After unmount:
// qemu-nbd -B gives each enabled bitmap the model's ranges and the disabled
// one what it had, nothing is in use, qemu-img check is clean, qcowfs map
// --bitmap prints what qemu-img map prints over qemu-nbd, and the copies
// the recipe made are the disk.
func TestBitmapsThroughMount(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "qemu-nbd", "blkdiscard", "losetup")
	for _, tc := range []struct {
		snap bool
		args []string
	}{{false, nil}, {true, []string{"--no-writeback-cache"}}} {
		t.Run(fmt.Sprintf("snapshot=%v%v", tc.snap, tc.args), func(t *testing.T) {
			src := qemu.TempDir(t)
			work := t.TempDir()
			img, gran := bitmapImage(t, src, tc.snap)
			before := map[string][][2]int64{}
			model := map[string]*granules{}
			for name, g := range gran {
				before[name] = qemu.DirtyRanges(t, img, name)
				model[name] = newGranules(g, before[name])
			}
			enabled := []string{"b64k", "b1m"}

			m := harness.Racy.Mount(t, src, append([]string{"--writable"}, tc.args...)...)
			logMount = m
			disk := filepath.Join(m.Dir, "vm.raw")
			full := map[string]string{}
			for _, name := range enabled {
				full[name] = filepath.Join(work, name+".full")
				harness.WantOK(t, "cp", harness.Exec(t, "cp", "--sparse=always", disk, full[name]))
			}
			if names := harness.Names(t, filepath.Join(m.Dir, "vm.raw.bitmaps")); !slices.Equal(names, []string{"b1m.raw", "b64k.raw", "off.raw"}) {
				t.Fatalf("vm.raw.bitmaps holds %v", names)
			}
			f := harness.OpenFile(t, disk, os.O_RDWR)
			size := int64(64 << 20)
			for _, op := range qemu.Ops(uint64(len(tc.args)), 40, size, 64<<10) {
				applyThrough(t, f, op)
				switch op.Kind {
				case qemu.OpWrite, qemu.OpDiscard, qemu.OpZero:
					for _, name := range enabled {
						model[name].add(op.Off, op.Len)
					}
				case qemu.OpResize:
					size = op.Off
				}
			}
			// Discards from a block device: the loop driver punches
			// the raw file.
			dev, detach := harness.AttachLoop(t, disk)
			for _, r := range [][2]int64{{5<<20 + 4096, 200 << 10}, {size - 3<<20, 1 << 20}} {
				qemu.Run(t, "blkdiscard", "-o", fmt.Sprint(r[0]), "-l", fmt.Sprint(r[1]), dev)
				for _, name := range enabled {
					model[name].add(r[0], r[1])
				}
			}
			detach()
			if err := f.Sync(); err != nil {
				t.Fatal(err)
			}
			// A view read, the disk written there, the view read again:
			// the new bytes, not pages the kernel kept of the first
			// read (the view is live).
			live := filepath.Join(m.Dir, "vm.raw.bitmaps", "b64k.raw")
			if _, err := os.ReadFile(live); err != nil {
				t.Fatal(err)
			}
			at, data := int64(7<<20+12345), bytes.Repeat([]byte("live"), 1024)
			if _, err := f.WriteAt(data, at); err != nil {
				t.Fatal(err)
			}
			if err := f.Sync(); err != nil {
				t.Fatal(err)
			}
			for _, name := range enabled {
				model[name].add(at, int64(len(data)))
			}
			if b, err := os.ReadFile(live); err != nil || !bytes.Equal(b[at:at+int64(len(data))], data) {
				t.Errorf("the view read after a write does not show it (%v)", err)
			}

			// The views, live.
			for name := range gran {
				want := model[name].ranges(size)
				if name == "off" {
					want = before[name]
				}
				view := filepath.Join(m.Dir, "vm.raw.bitmaps", name+".raw")
				v := harness.Open(t, view)
				var st syscall.Stat_t
				if err := syscall.Fstat(int(v.Fd()), &st); err != nil {
					t.Fatal(err)
				}
				if got := harness.SeekRuns(t, v, st.Size); st.Size != size || !slices.Equal(got, want) {
					t.Errorf("view %s: %d bytes, data %v; want %d bytes, %v\n%s", name, st.Size, got, size, want, m.LogText(t))
				}
				if st.Blocks*512 != bytesIn(want) {
					t.Errorf("view %s: st_blocks %d, want the dirty bytes %d / 512", name, st.Blocks, bytesIn(want))
				}
				v.Close()
			}
			for _, name := range enabled {
				runRecipe(t, filepath.Join(m.Dir, "vm.raw.bitmaps", name+".raw"), full[name])
			}
			// The incremental kept as a file of its own, applied later.
			incr, later := filepath.Join(work, "b64k.incr"), filepath.Join(work, "later.full")
			harness.WantOK(t, "cp", harness.Exec(t, "cp", "--sparse=always", full["b64k"], later))
			runRecipe(t, filepath.Join(m.Dir, "vm.raw.bitmaps", "b64k.raw"), incr)
			f.Close()
			m.Unmount(t)
			harness.WaitGone(t, m.Dir)
			runRecipe(t, incr, later)

			info := string(qemu.Img(t, "info", img))
			if strings.Contains(info, "in-use") {
				t.Errorf("a bitmap is in use after unmount:\n%s", info)
			}
			qemu.CheckClean(t, img)
			for name := range gran {
				want := model[name].ranges(size)
				if name == "off" {
					want = before[name]
				}
				if got := qemu.DirtyRanges(t, img, name); !slices.Equal(got, want) {
					t.Errorf("bitmap %s: qemu says dirty %v, want %v", name, got, want)
				}
				sameBitmapMap(t, img, name)
			}
			raw := qemu.ToRaw(t, img, filepath.Join(work, "now.raw"))
			for _, copy := range []string{full["b64k"], full["b1m"], later} {
				if out, err := exec.Command("cmp", copy, raw).CombinedOutput(); err != nil {
					t.Errorf("the full copy with the view laid over it is not the disk: %v %s", err, out)
				}
			}
			m.NoPanics(t)
		})
	}
}

// TestBitmapsKillDaemon: the daemon of a writable mount is killed (-9)
// while a writer writes and fsyncs an image with an enabled and a disabled
// bitmap. Once a write was acknowledged, the enabled bitmap is in use
// (qemu-img info), so qemu-nbd and qcowfs map --bitmap refuse it rather
// than read it without the lost bits; the disabled one is not; qemu-img
// check finds no corruption; a mount shows the image read-only, with the
// disabled bitmap's view only.
func TestBitmapsKillDaemon(t *testing.T) {
	harness.RequireFUSE(t)
	qemu.Require(t, "qemu-nbd")
	r := rand.New(rand.NewPCG(36, 36))
	for round := range 4 {
		t.Run(fmt.Sprint(round), func(t *testing.T) {
			src := qemu.TempDir(t)
			img := filepath.Join(src, "vm.qcow2")
			qemu.Create(t, "qcow2", img, "1G")
			qemu.Img(t, "bitmap", "--add", img, "on")
			qemu.Img(t, "bitmap", "--add", "--disable", img, "off")
			args := []string{"--writable"}
			if round%2 == 1 {
				args = append(args, "--no-writeback-cache")
			}
			m := harness.Mount(t, src, args...)
			daemon := harness.DaemonOf(t, m.Dir)
			f := harness.OpenFile(t, filepath.Join(m.Dir, "vm.raw"), os.O_RDWR)
			seed := uint64(100 + round)
			acked := make(chan uint64, 1<<16)
			done := make(chan struct{})
			go func() {
				defer close(done)
				for seq := uint64(1); ; seq++ {
					off := killOffset(seed, seq)
					if _, err := f.WriteAt(killRecordAt(seq, off), off); err != nil {
						return
					}
					if seq%4 == 0 {
						if err := f.Sync(); err != nil {
							return
						}
						acked <- seq
					}
				}
			}()
			<-acked // a write acknowledged; the kill comes at a random moment after it
			time.Sleep(time.Duration(r.IntN(500)) * time.Millisecond)
			syscall.Kill(daemon, syscall.SIGKILL)
			select {
			case <-done:
			case <-time.After(30 * time.Second):
				t.Fatal("the writer did not notice the daemon was gone")
			}
			f.Close()
			harness.WaitGone(t, m.Dir)
			exec.Command("fusermount3", "-uz", m.Dir).Run()

			var info struct {
				FormatSpecific struct {
					Data struct {
						Bitmaps []struct {
							Name  string
							Flags []string
						}
					}
				} `json:"format-specific"`
			}
			if err := json.Unmarshal(qemu.Img(t, "info", "--output=json", img), &info); err != nil {
				t.Fatal(err)
			}
			flags := map[string][]string{}
			for _, b := range info.FormatSpecific.Data.Bitmaps {
				flags[b.Name] = b.Flags
			}
			if !slices.Contains(flags["on"], "in-use") {
				t.Errorf("after kill -9 the enabled bitmap is not in use: flags %v", flags["on"])
			}
			if slices.Contains(flags["off"], "in-use") {
				t.Errorf("after kill -9 the disabled bitmap is in use: flags %v", flags["off"])
			}
			check := harness.Exec(t, "qemu-img", "check", img)
			if check.Code != 0 && check.Code != 3 {
				t.Fatalf("qemu-img check after kill -9 (exit %d):\n%s%s", check.Code, check.Stdout, check.Stderr)
			}
			if qemu.ExportsBitmap(t, img, "on") {
				t.Error("qemu-nbd exports the bitmap in use")
			}
			harness.WantError(t, "qcowfs map --bitmap on", harness.Run(t, "map", "--bitmap", "on", img), "in use")
			harness.WantOK(t, "qcowfs map --bitmap off", harness.Run(t, "map", "--bitmap", "off", img))

			m2 := harness.Mount(t, src, "--writable")
			if _, err := os.OpenFile(filepath.Join(m2.Dir, "vm.raw"), os.O_RDWR, 0); !errors.Is(err, syscall.EROFS) {
				t.Errorf("open for writing after the crash: %v, want EROFS", err)
			}
			if names := harness.Names(t, filepath.Join(m2.Dir, "vm.raw.bitmaps")); !slices.Equal(names, []string{"off.raw"}) {
				t.Errorf("after the crash vm.raw.bitmaps holds %v, want off.raw alone", names)
			}
			log := m2.LogText(t)
			for _, want := range []string{"image shown read-only", "bitmap view not shown"} {
				if !strings.Contains(log, want) {
					t.Errorf("the log does not say %q:\n%s", want, log)
				}
			}
		})
	}
}

// TestBitmapImageReopened: an image with bitmaps, written and closed and
// opened again at once, again and again (its views stat'ed between), stays
// writable: the open waits for the last close, which clears in_use (and
// gives back space), instead of finding the bitmap in use and opening the
// image read-only.
func TestBitmapImageReopened(t *testing.T) {
	src := harness.SourceDir(t)
	img := filepath.Join(src, "vm.qcow2")
	qemu.Create(t, "qcow2", img, "16M")
	qemu.Img(t, "bitmap", "--add", img, "daily")
	m := harness.Racy.Mount(t, src, "--writable")
	disk := filepath.Join(m.Dir, "vm.raw")
	model := newGranules(64<<10, nil)
	for i := range 200 {
		f, err := os.OpenFile(disk, os.O_RDWR, 0)
		if err != nil {
			t.Fatalf("open %d for writing: %v\n%s", i, err, m.LogText(t))
		}
		off := int64(i%200) * 80 << 10
		if _, err := f.WriteAt(bytes.Repeat([]byte{byte(i)}, 4096), off); err != nil {
			t.Fatal(err)
		}
		model.add(off, 4096)
		if err := f.Close(); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(filepath.Join(m.Dir, "vm.raw.bitmaps", "daily.raw")); err != nil {
			t.Fatalf("stat of the view after close %d: %v\n%s", i, err, m.LogText(t))
		}
	}
	m.Unmount(t)
	harness.WaitGone(t, m.Dir)
	if log := m.LogText(t); strings.Contains(log, "read-only") || strings.Contains(log, "not shown") {
		t.Errorf("the image was opened read-only (or a view not shown) along the way:\n%s", log)
	}
	if got, want := qemu.DirtyRanges(t, img, "daily"), model.ranges(16<<20); !slices.Equal(got, want) {
		t.Errorf("qemu says dirty %v, want %v", got, want)
	}
	qemu.CheckClean(t, img)
}
