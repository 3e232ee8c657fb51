package main

import (
	"fmt"
	"sort"
	"strings"

	"github.com/alecthomas/kong"
)

// Mount options (-o, as mount(8) and fstab pass them) are qcowfs's own
// mount flags, spelled with underscores: -o cache_size=64M is
// --cache-size=64M, -o allow_other is --allow-other. The table is the
// kong model itself, so a new flag is an option too, and the help and the
// README cannot drift from the parser. Other options are either mount(8)'s
// and the kernel's generic ones, which say nothing qcowfs acts on, or
// options of other FUSE file systems, each refused with the reason.

// ignoredOptions are accepted and ignored, with why.
var ignoredOptions = map[string]string{
	"rw": "the mount is read-only unless writable is given", "defaults": "mount(8)'s defaults",
	"dev": "", "nodev": "", "suid": "", "nosuid": "", "exec": "", "noexec": "",
	"auto": "", "noauto": "", "user": "", "nouser": "", "users": "", "owner": "", "group": "",
	"_netdev": "", "comment": "",
	"atime": "", "noatime": "", "relatime": "", "norelatime": "", "strictatime": "",
	"nostrictatime": "", "lazytime": "", "nolazytime": "", "diratime": "", "nodiratime": "",
	"sync": "", "async": "", "dirsync": "",
	"default_permissions": "always on: the kernel checks file permissions",
	"nonempty":            "FUSE 3 mounts over non-empty folders anyway",
	"kernel_cache":        "image contents are kept in the kernel's page cache already",
	"writeback_cache":     "on by default with writable (no_writeback_cache turns it off)",
}

// refusedOptions are options of other FUSE file systems that qcowfs does
// not provide, with the reason and what to do instead.
var refusedOptions = map[string]string{
	"allow_root":   "not supported; use allow_other (file permissions still apply)",
	"auto_unmount": "not supported; if the daemon dies, run qcowfs unmount -z MNT and mount again",
	"uid":          "not supported: files keep the owner of their source file",
	"gid":          "not supported: files keep the group of their source file",
	"umask":        "not supported: files keep the permission bits of their source file (minus write)",
	"context":      "SELinux mount contexts are not supported",
	"fscontext":    "SELinux mount contexts are not supported",
	"defcontext":   "SELinux mount contexts are not supported",
	"rootcontext":  "SELinux mount contexts are not supported",
	"max_read":     "qcowfs sets max_read itself (just under 1 MiB, so that zero-copy replies fit a pipe)",
	"blkdev":       "not supported: qcowfs is not a block device file system",
	"direct_io":    "not supported: reads go through the page cache",
	"hard_remove":  "not supported",
	"use_ino":      "always on: inode numbers come from the source files",
	"setuid":       "not supported by qcowfs (mount.fuse3's setuid= must come before qcowfs runs)",
}

// An optionFlag is a mount flag usable as an -o option.
type optionFlag struct {
	option string // cache_size
	flag   *kong.Flag
}

// optionFlags lists the mount flags that are -o options: every visible
// flag but -o itself.
func optionFlags(mount *kong.Node) []optionFlag {
	var out []optionFlag
	for _, f := range mount.Flags {
		if f.Hidden || f.Name == "options" || f.Name == "help" {
			continue
		}
		out = append(out, optionFlag{option: strings.ReplaceAll(f.Name, "-", "_"), flag: f})
	}
	return out
}

// rewriteOptions replaces every -o OPTS of the mount command line
// inv.args with the flags they stand for; inv.fromOption records which
// flag came from which option, for error messages, and inv.rwOption
// whether the rw option was among them.
func rewriteOptions(mount *kong.Node, inv *invocation) error {
	args, err := rewrittenOptions(mount, inv.args, inv.fromOption, &inv.rwOption)
	if err != nil {
		return err
	}
	inv.args = args
	return nil
}

func rewrittenOptions(mount *kong.Node, args []string, fromOption map[string]string, rw *bool) ([]string, error) {
	flags := map[string]*kong.Flag{}
	for _, of := range optionFlags(mount) {
		flags[of.option] = of.flag
	}
	out := append([]string(nil), args[:2]...)
	for i := 2; i < len(args); i++ {
		a := args[i]
		var list string
		switch {
		case a == "--":
			return append(out, args[i:]...), nil
		case a == "-o" || a == "--options":
			if i+1 == len(args) {
				return nil, fmt.Errorf("%s needs a list of options (see qcowfs mount --help)", a)
			}
			i++
			list = args[i]
		case strings.HasPrefix(a, "--options="):
			list = strings.TrimPrefix(a, "--options=")
		case strings.HasPrefix(a, "-o") && !strings.HasPrefix(a, "--"):
			list = a[2:]
		default:
			out = append(out, a)
			continue
		}
		for _, o := range splitOptions(list) {
			if o == "rw" {
				*rw = true
			}
			f, err := optionToFlag(o, flags)
			if err != nil {
				return nil, err
			}
			if f != "" {
				name, _, _ := strings.Cut(f, "=")
				fromOption[name] = strings.SplitN(o, "=", 2)[0]
				out = append(out, f)
			}
		}
	}
	return out, nil
}

// optionalValue tells a flag that goes with or without a value
// (--hydrate[=RATE]) from a bool flag.
func optionalValue(f *kong.Flag) bool {
	if !f.Target.CanAddr() {
		return false
	}
	_, ok := f.Target.Addr().Interface().(*hydrateFlag)
	return ok
}

// optionToFlag returns the flag that option o stands for, "" for an
// option that is ignored, or why o is refused.
func optionToFlag(o string, flags map[string]*kong.Flag) (string, error) {
	key, val, hasVal := strings.Cut(o, "=")
	if f, ok := flags[key]; ok {
		if f.IsBool() {
			if hasVal && optionalValue(f) {
				return "--" + f.Name + "=" + val, nil
			}
			if hasVal {
				return "", fmt.Errorf("option %s takes no value (see qcowfs mount --help)", key)
			}
			return "--" + f.Name, nil
		}
		if !hasVal || val == "" {
			return "", fmt.Errorf("option %s needs a value: %s=%s (see qcowfs mount --help)", key, key, f.FormatPlaceHolder())
		}
		return "--" + f.Name + "=" + val, nil
	}
	switch {
	case key == "":
		return "", nil
	case key == "nofail":
		return "--nofail", nil
	case key == "ro":
		// ro wins over writable, wherever it comes.
		return "--ro", nil
	case key == "subtype":
		if val != "qcowfs" {
			return "", fmt.Errorf("option %s: the type stays fuse.qcowfs (qcowfs unmount and status find their mounts by it)", o)
		}
		return "", nil
	case strings.HasPrefix(key, "x-"):
		// Options for other programs (systemd, ...), by convention.
		return "", nil
	}
	if _, ok := ignoredOptions[key]; ok {
		return "", nil
	}
	if why, ok := refusedOptions[key]; ok {
		return "", fmt.Errorf("option %s: %s", o, why)
	}
	return "", fmt.Errorf("unknown mount option %q (see qcowfs mount --help)", o)
}

// splitOptions splits a comma-separated option list as libmount does: a
// comma inside double quotes does not split, and the quotes go
// (allow_backing_outside="/srv/a,b").
func splitOptions(list string) []string {
	var out []string
	var cur strings.Builder
	quoted := false
	for i := 0; i < len(list); i++ {
		switch c := list[i]; {
		case c == '"':
			quoted = !quoted
		case c == ',' && !quoted:
			out = append(out, strings.TrimSpace(cur.String()))
			cur.Reset()
		default:
			cur.WriteByte(c)
		}
	}
	return append(out, strings.TrimSpace(cur.String()))
}

// optionsHelp is the help of -o, listing what the table holds.
func optionsHelp() string {
	ignored := make([]string, 0, len(ignoredOptions))
	for k := range ignoredOptions {
		ignored = append(ignored, k)
	}
	sort.Strings(ignored)
	refused := make([]string, 0, len(refusedOptions))
	for k := range refusedOptions {
		refused = append(refused, k)
	}
	sort.Strings(refused)
	return "Options in mount(8) style, comma-separated: every flag above, with underscores " +
		"(-o cache_size=64M,allow_other,allow_backing_outside=\"/a,b\"); nofail; subtype=qcowfs. " +
		"Accepted and ignored: " + strings.Join(ignored, ", ") + ", x-*. " +
		"Refused, with the reason: " + strings.Join(refused, ", ") + "."
}
