// Package mountinfo reads /proc/self/mountinfo (proc(5)): which mounts
// this process sees, with their escaped fields decoded. It is the one
// parser the command and the tests share.
package mountinfo

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
)

// A Mount is one line of mountinfo:
//
//	36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue
//	ID Parent MajMin Root Point Options [optional...] - FSType Source SuperOptions
type Mount struct {
	ID, Parent   int
	MajMin       string // st_dev of the mount, "0:38"; for FUSE the minor is the connection number
	Root         string // the folder of the file system mounted here
	Point        string // the mount point, relative to the process's root
	Options      string // per-mount options: "ro,nosuid,nodev,relatime"
	Optional     []string
	FSType       string // "fuse.qcowfs", "tmpfs", ...
	Source       string // "none" where the file system has none
	SuperOptions string // per-superblock options
}

// Parse reads mountinfo lines from r. A line that does not have the
// fields of proc(5) is an error naming the line, not skipped: a silently
// dropped mount would make a mount point look free.
func Parse(r io.Reader) ([]Mount, error) {
	var out []Mount
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if line == "" {
			continue
		}
		m, err := parseLine(line)
		if err != nil {
			return nil, fmt.Errorf("mountinfo line %d %q: %w", n, line, err)
		}
		out = append(out, m)
	}
	return out, sc.Err()
}

func parseLine(line string) (Mount, error) {
	f := strings.Split(line, " ")
	sep := -1
	for i := 6; i < len(f); i++ {
		if f[i] == "-" {
			sep = i
			break
		}
	}
	if sep < 0 || sep+3 >= len(f) {
		return Mount{}, fmt.Errorf("want at least 10 fields with a \"-\" separator")
	}
	id, err1 := strconv.Atoi(f[0])
	parent, err2 := strconv.Atoi(f[1])
	if err1 != nil || err2 != nil {
		return Mount{}, fmt.Errorf("mount ID %q or parent ID %q is not a number", f[0], f[1])
	}
	m := Mount{
		ID: id, Parent: parent, MajMin: f[2],
		Root: Unescape(f[3]), Point: Unescape(f[4]), Options: f[5],
		FSType: Unescape(f[sep+1]), Source: Unescape(f[sep+2]), SuperOptions: f[sep+3],
	}
	if sep > 6 {
		m.Optional = f[6:sep]
	}
	return m, nil
}

// Unescape undoes the kernel's octal escapes in mountinfo fields: space
// (\040), tab (\011), newline (\012) and backslash (\134) are written as
// a backslash and three octal digits (fs/proc_namespace.c, mangle()).
func Unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// Read parses /proc/self/mountinfo.
func Read() ([]Mount, error) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	return Parse(bytes.NewReader(b))
}

// Top returns the topmost of the mounts on point (an absolute path
// without symlinks), or nil if nothing is mounted there. Mounts stacked
// on one point are told apart by parentage: the top one is the parent of
// no other mount on that point. (mountinfo lists mounts in the order they
// were made, but a mount moved or propagated later breaks that order.)
func Top(mounts []Mount, point string) *Mount {
	var on []*Mount
	for i := range mounts {
		if mounts[i].Point == point {
			on = append(on, &mounts[i])
		}
	}
	for _, m := range on {
		top := true
		for _, o := range on {
			if o != m && o.Parent == m.ID {
				top = false
				break
			}
		}
		if top {
			return m
		}
	}
	return nil
}

// At reads /proc/self/mountinfo and returns the topmost mount on point,
// or nil.
func At(point string) (*Mount, error) {
	mounts, err := Read()
	if err != nil {
		return nil, err
	}
	return Top(mounts, point), nil
}
