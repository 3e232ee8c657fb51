package mountinfo

import (
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	// Lines as the kernel writes them: a mount point and a source with a
	// space, a tab and a backslash in them (escaped as \040, \011 and
	// \134), optional fields, none, and two mounts stacked on /mnt/a b.
	const text = `22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro
40 22 0:38 / /mnt/a\040b rw,nosuid shared:20 master:3 - tmpfs qcowfs\011test rw,size=1024k
41 40 0:39 / /mnt/a\040b ro,nosuid,nodev - fuse.qcowfs /srv/x\134y\040z ro,user_id=0,group_id=0,allow_other
`
	got, err := Parse(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	want := []Mount{
		{ID: 22, Parent: 1, MajMin: "8:1", Root: "/", Point: "/", Options: "rw,relatime", Optional: []string{"shared:1"},
			FSType: "ext4", Source: "/dev/sda1", SuperOptions: "rw,errors=remount-ro"},
		{ID: 40, Parent: 22, MajMin: "0:38", Root: "/", Point: "/mnt/a b", Options: "rw,nosuid", Optional: []string{"shared:20", "master:3"},
			FSType: "tmpfs", Source: "qcowfs\ttest", SuperOptions: "rw,size=1024k"},
		{ID: 41, Parent: 40, MajMin: "0:39", Root: "/", Point: "/mnt/a b", Options: "ro,nosuid,nodev",
			FSType: "fuse.qcowfs", Source: `/srv/x\y z`, SuperOptions: "ro,user_id=0,group_id=0,allow_other"},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("Parse:\n got %+v\nwant %+v", got, want)
	}
	if top := Top(got, "/mnt/a b"); top == nil || top.ID != 41 {
		t.Errorf("Top(/mnt/a b) = %+v, want mount 41 (stacked on 40)", top)
	}
	// Listed out of order (a mount moved later): parentage still says
	// which one is on top.
	rev := []Mount{got[2], got[1], got[0]}
	if top := Top(rev, "/mnt/a b"); top == nil || top.ID != 41 {
		t.Errorf("Top on reordered lines = %+v, want mount 41", top)
	}
	if top := Top(got, "/mnt"); top != nil {
		t.Errorf("Top(/mnt) = %+v, want nil", top)
	}
}

func TestParseErrors(t *testing.T) {
	for _, line := range []string{
		"22 1 8:1 / / rw,relatime shared:1 ext4 /dev/sda1 rw", // no separator
		"22 1 8:1 / / rw - ext4 /dev/sda1",                    // no super options
		"x 1 8:1 / / rw - ext4 /dev/sda1 rw",                  // ID not a number
	} {
		if m, err := Parse(strings.NewReader(line + "\n")); err == nil {
			t.Errorf("Parse(%q) = %+v, want an error", line, m)
		}
	}
}

func TestUnescape(t *testing.T) {
	for in, want := range map[string]string{
		`plain`: "plain", `a\040b`: "a b", `\134`: `\`, `tab\011`: "tab\t", `nl\012x`: "nl\nx",
		// Not an escape: left as is.
		`a\9b`: `a\9b`, `end\04`: `end\04`,
	} {
		if got := Unescape(in); got != want {
			t.Errorf("Unescape(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestRealMount: a tmpfs mounted on a folder whose name the kernel must
// escape is found at that path, and a second one stacked on it is the top.
func TestRealMount(t *testing.T) {
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("needs root")
		}
		t.Skip("needs root")
	}
	dir := filepath.Join(t.TempDir(), "a b\tc\\d")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for i, src := range []string{"first one", "second"} {
		if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=64k", src, dir).CombinedOutput(); err != nil {
			t.Fatalf("mount tmpfs %d: %v %s", i, err, out)
		}
		t.Cleanup(func() { exec.Command("umount", dir).Run() })
	}
	m, err := At(dir)
	if err != nil {
		t.Fatal(err)
	}
	if m == nil || m.FSType != "tmpfs" || m.Source != "second" {
		t.Fatalf("At(%q) = %+v, want the second tmpfs", dir, m)
	}
}
