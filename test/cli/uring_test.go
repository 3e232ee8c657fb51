package cli

// --io-uring: which transport a mount serves over, by the kernel's switch.

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
)

const uringParam = "/sys/module/fuse/parameters/enable_uring"

// setUring sets the kernel's FUSE-over-io_uring switch for the test and
// puts it back after.
func setUring(t *testing.T, v string) {
	t.Helper()
	prev, err := os.ReadFile(uringParam)
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("the kernel lacks FUSE over io_uring (%v); CI runs on one that has it", err)
		}
		t.Skipf("the kernel lacks FUSE over io_uring: %v", err)
	}
	if err := os.WriteFile(uringParam, []byte(v), 0); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.WriteFile(uringParam, []byte(strings.TrimSpace(string(prev))), 0) })
}

// ringCompletions is what the kernel says of the daemon's io_uring
// instances: how many there are and how many completions (one per FUSE
// request served) they have had, from /proc/PID/fdinfo.
func ringCompletions(t *testing.T, pid int) (rings, completions int) {
	t.Helper()
	fds, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/fd")
	if err != nil {
		t.Fatal(err)
	}
	for _, fd := range fds {
		link, _ := os.Readlink(filepath.Join("/proc", strconv.Itoa(pid), "fd", fd.Name()))
		if link != "anon_inode:[io_uring]" {
			continue
		}
		rings++
		info, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "fdinfo", fd.Name()))
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(info), "\n") {
			if v, ok := strings.CutPrefix(line, "CqHead:"); ok {
				n, err := strconv.Atoi(strings.TrimSpace(v))
				if err != nil {
					t.Fatalf("fdinfo: %q", line)
				}
				completions += n
			}
		}
	}
	return rings, completions
}

// TestIOUring: with the kernel's switch on, auto and on serve over the
// rings (the kernel counts their completions) and the raw file reads as
// qemu-img converts it; off stays on /dev/fuse. With the switch off, on
// fails the mount naming the switch, and auto mounts on /dev/fuse with
// one log line saying why.
func TestIOUring(t *testing.T) {
	harness.RequireFUSE(t)
	src := t.TempDir()
	_, raw := smallImage(t, src, "vm")
	for _, tc := range []struct {
		param, mode string
		ring        bool
		fails       []string // what the error names
		line        string   // the log line, exactly once
	}{
		{param: "Y", mode: "auto", ring: true, line: "serving over io_uring"},
		{param: "Y", mode: "on", ring: true, line: "serving over io_uring"},
		{param: "Y", mode: "off"},
		{param: "N", mode: "on", fails: []string{"--io-uring=on", uringParam, "is N", "echo Y"}},
		{param: "N", mode: "auto", line: "serving over /dev/fuse"},
	} {
		t.Run(tc.param+"/"+tc.mode, func(t *testing.T) {
			setUring(t, tc.param)
			m, out, err := harness.Racy.TryMount(t, src, "--io-uring="+tc.mode)
			if tc.fails != nil {
				if err == nil {
					t.Fatalf("mounted; want the mount to fail")
				}
				for _, w := range tc.fails {
					if !strings.Contains(out, w) {
						t.Errorf("the error does not name %q: %s", w, out)
					}
				}
				return
			}
			if err != nil {
				t.Fatalf("%v: %s", err, out)
			}
			harness.SameFile(t, filepath.Join(m.Dir, "vm.raw"), raw)
			rings, completions := ringCompletions(t, m.PID(t))
			if tc.ring && (rings == 0 || completions == 0) {
				t.Errorf("%d io_uring instances with %d completions; want the reads served over rings", rings, completions)
			}
			if !tc.ring && rings != 0 {
				t.Errorf("%d io_uring instances; want none", rings)
			}
			want := "/dev/fuse"
			if tc.ring {
				want = "io_uring"
			}
			var st struct{ Transport string }
			harness.Run(t, "status", "--output=json", m.Dir).JSON(t, &st)
			if st.Transport != want {
				t.Errorf("qcowfs status says transport %q, want %q", st.Transport, want)
			}
			log := m.LogText(t)
			if tc.line != "" && harness.CountLines(log, tc.line) != 1 {
				t.Errorf("want one log line %q:\n%s", tc.line, log)
			}
			if !tc.ring && strings.Contains(log, "serving over io_uring") {
				t.Errorf("the log says it serves over io_uring:\n%s", log)
			}
		})
	}
}
