package main

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/qcowfs/qcowfs/internal/mountinfo"
)

// When mount(8) mounts a fuse.qcowfs file system it runs mount.fuse3,
// which runs "/bin/sh -c 'qcowfs SRC MNT -o OPTS'" in its own process
// (mount.fuse.c): by then mount(8)'s -f (fake) and the nofail option are
// gone, as mount.fuse3 drops both. So qcowfs reads them where they still
// are: in the command line of the mount(8) above it (-f, --fake, -o), and
// for nofail in the fstab line mount(8) mounts (its --fstab FILE, or
// /etc/fstab), found by mount point.

// A mountParent is what the mount(8) that runs qcowfs asked for.
type mountParent struct {
	pid          int
	fake, nofail bool
	// rw: the user asked for rw (-w, --rw, -o rw, or rw in the fstab
	// line), rather than mount(8) passing it as it always does.
	rw bool
}

// fuseHelperParent returns the mount(8) process qcowfs runs under
// through mount.fuse3 (its parent, or its grandparent with the shell
// mount.fuse3 became in between), or nil.
func fuseHelperParent() *mountParent {
	pid := os.Getppid()
	for depth := 0; depth < 2 && pid > 1; depth++ {
		argv := procArgs(pid)
		if len(argv) == 0 {
			return nil
		}
		switch filepath.Base(argv[0]) {
		case "mount":
			return parseMountArgs(pid, argv[1:], os.Args)
		case "sh", "dash", "bash", "mount.fuse3", "mount.fuse", "mount.fuseblk":
			pid = procParent(pid)
		default:
			return nil
		}
	}
	return nil
}

// procArgs returns the command line of process pid.
func procArgs(pid int) []string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil || len(b) == 0 {
		return nil
	}
	return strings.Split(strings.TrimSuffix(string(b), "\x00"), "\x00")
}

// procParent returns the parent of pid, from /proc/PID/stat (the fields
// after the command name, which is in parentheses and may hold anything).
func procParent(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 2 {
		return 0
	}
	ppid, _ := strconv.Atoi(f[1])
	return ppid
}

// mountOptsWithArg are mount(8)'s short options that take an argument
// (util-linux sys-utils/mount.c: "aBcfFhilL:Mno:O:rRsU:vVwt:T:N:").
const mountOptsWithArg = "LoOUtTN"

// mountLongWithArg are its long options that take one as the next word.
var mountLongWithArg = map[string]bool{
	"options": true, "test-opts": true, "types": true, "fstab": true, "label": true, "uuid": true,
	"namespace": true, "source": true, "target": true, "target-prefix": true, "options-mode": true,
	"options-source": true, "map-users": true, "map-groups": true,
}

// parseMountArgs reads a mount(8) command line: whether it fakes, and
// whether the mount it makes for us (our own args: qcowfs SRC MNT ...)
// has nofail, on its command line or in its fstab.
func parseMountArgs(pid int, args, ours []string) *mountParent {
	p := &mountParent{pid: pid}
	fstab := "/etc/fstab"
	var opts []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		next := func() string {
			if i+1 < len(args) {
				i++
				return args[i]
			}
			return ""
		}
		switch {
		case a == "--":
			i = len(args)
		case strings.HasPrefix(a, "--"):
			name, val, hasVal := strings.Cut(a[2:], "=")
			if !hasVal && mountLongWithArg[name] {
				val = next()
			}
			switch name {
			case "rw", "read-write":
				p.rw = true
			case "fake":
				p.fake = true
			case "options":
				opts = append(opts, val)
			case "fstab":
				fstab = val
			}
		case strings.HasPrefix(a, "-") && len(a) > 1:
			for j := 1; j < len(a); j++ {
				c := a[j]
				if strings.IndexByte(mountOptsWithArg, c) >= 0 {
					val := a[j+1:]
					if val == "" {
						val = next()
					}
					switch c {
					case 'o':
						opts = append(opts, val)
					case 'T':
						fstab = val
					}
					break
				}
				switch c {
				case 'f':
					p.fake = true
				case 'w':
					p.rw = true
				}
			}
		}
	}
	if len(ours) >= 3 {
		// mount(8) merges the fstab line's options with its own.
		opts = append(opts, fstabOptions(fstab, ours[2])...)
	}
	for _, o := range opts {
		for _, x := range splitOptions(o) {
			switch x {
			case "nofail":
				p.nofail = true
			case "rw":
				p.rw = true
			}
		}
	}
	return p
}

// fstabOptions returns the options of the fstab line for mount point mnt
// (as qcowfs was given it), if there is one.
func fstabOptions(fstab, mnt string) []string {
	f, err := os.Open(fstab)
	if err != nil {
		return nil
	}
	defer f.Close()
	// mount(8) hands its helper the mount point canonicalized; the
	// fstab may name it through a symlink.
	canon := func(p string) string {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			return real
		}
		return filepath.Clean(p)
	}
	want := canon(mnt)
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' {
			continue
		}
		fields := strings.Fields(line)
		if len(fields) < 4 || canon(mountinfo.Unescape(fields[1])) != want {
			continue
		}
		return []string{fields[3]}
	}
	return nil
}
