package main

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"github.com/alecthomas/kong"
)

// An invocation is the command line after the mount helper convention and
// -o options have been turned into qcowfs's own flags.
type invocation struct {
	args []string // what kong parses (args[0] is the program)
	// helper is set when qcowfs was called as a mount helper (by
	// mount(8) or mount.fuse3) rather than as "qcowfs mount".
	helper bool
	// fromOption maps a flag made from an -o option back to the option
	// as written, for messages: "--cache-size" -> "cache_size".
	fromOption map[string]string
	// rwOption: the user gave the rw option (mount(8) passes it to
	// every helper unasked: then only if its command line or the fstab
	// line has it too).
	rwOption bool
}

// prepareArgs recognizes the mount helper calling conventions, rewrites
// "help CMD" and -o options, and rejects a command name that is not one,
// so that a typo is not taken for the source of a mount.
func prepareArgs(app *kong.Application, args []string) (*invocation, error) {
	inv := &invocation{args: args, fromOption: map[string]string{}}
	if len(args) < 2 {
		// "qcowfs" alone is a request for the help page.
		inv.args = []string{args[0], "--help"}
		return inv, nil
	}
	commands := commandNames(app)
	byMount := strings.HasPrefix(filepath.Base(args[0]), "mount.")
	first := args[1]
	switch {
	case byMount:
		// /sbin/mount.qcowfs or /sbin/mount.fuse.qcowfs, run by
		// mount(8): SRC MNT [-sfnv] [-o OPTS] [-t TYPE] [-N NS].
		out, err := helperArgs(args, true)
		if err != nil {
			return nil, err
		}
		inv.args, inv.helper = out, true
	case first == "help" && !slices.ContainsFunc(args[2:], func(a string) bool { return strings.HasPrefix(a, "-") }):
		// "qcowfs help [CMD]" is "qcowfs [CMD] --help" ("qcowfs
		// help --help" is the help command's own).
		out := []string{args[0]}
		for _, a := range args[2:] {
			if !commands[a] {
				return nil, unknownCommand(a, commands)
			}
			out = append(out, a)
		}
		inv.args = append(out, "--help")
	case strings.HasPrefix(first, "-") || commands[first]:
	case looksLikeHelper(args):
		// mount.fuse3 runs "qcowfs SRC MNT -o OPTS" (and so may a
		// user, as with any libfuse file system).
		out, err := helperArgs(args, false)
		if err != nil {
			return nil, err
		}
		inv.args, inv.helper = out, true
	default:
		return nil, unknownCommand(first, commands)
	}
	if len(inv.args) > 1 && inv.args[1] == "mount" {
		if err := rewriteOptions(mountNode(app), inv); err != nil {
			return nil, err
		}
		if inv.rwOption && inv.helper {
			if p := fuseHelperParent(); p != nil && !p.rw {
				inv.rwOption = false
			}
		}
	}
	return inv, nil
}

// looksLikeHelper tells "qcowfs SRC MNT ..." from a mistyped command: the
// first word names an existing file or has a slash in it, or qcowfs runs
// under mount.fuse3.
func looksLikeHelper(args []string) bool {
	if len(args) < 3 || strings.HasPrefix(args[2], "-") {
		return false
	}
	if strings.Contains(args[1], "/") || fuseHelperParent() != nil {
		return true
	}
	_, err := os.Stat(args[1])
	return err == nil
}

// helperArgs turns the helper convention into a mount command. mount(8)
// passes -s (sloppy), -f (fake), -n (no mtab), -v (verbose), -o OPTS,
// -t TYPE for a helper whose name does not end with the type, and -N NS
// to mount in another namespace (libmount's exec_helper); mount.fuse3
// passes only -o (mount.fuse.c), and then "-f" would be libfuse's
// --foreground.
func helperArgs(args []string, byMount bool) ([]string, error) {
	out := []string{args[0], "mount"}
	for i := 1; i < len(args); i++ {
		a := args[i]
		switch {
		case a == "-n", a == "-s", a == "-v":
			continue
		case a == "-t" && byMount:
			i++ // and its value
			continue
		case a == "-N" && byMount:
			return nil, fmt.Errorf("-N %s: mounting into another mount namespace (X-mount.namespace) is not supported", strings.Join(args[i+1:min(i+2, len(args))], ""))
		case a == "-f" && byMount:
			// Fake: mount(8) only records the mount.
			out = append(out, "--fake")
			continue
		}
		out = append(out, a)
	}
	if p := fuseHelperParent(); p != nil {
		// mount.fuse3 drops mount(8)'s -f and the nofail option
		// before running us; read them from its own command line.
		if p.fake {
			out = append(out, "--fake")
		}
		if p.nofail {
			out = append(out, "--nofail")
		}
	}
	return out, nil
}

// commandNames returns the names and aliases of the visible commands.
func commandNames(app *kong.Application) map[string]bool {
	names := map[string]bool{}
	for _, n := range app.Children {
		names[n.Name] = true
		for _, a := range n.Aliases {
			names[a] = true
		}
	}
	return names
}

func mountNode(app *kong.Application) *kong.Node {
	for _, n := range app.Children {
		if n.Name == "mount" {
			return n
		}
	}
	panic("no mount command")
}

// unknownCommand says that name is no command, and suggests the nearest
// one when it is a likely typo.
func unknownCommand(name string, commands map[string]bool) error {
	var visible []string
	for c := range commands {
		if c != "help-man" {
			visible = append(visible, c)
		}
	}
	sort.Strings(visible)
	best, bestD := "", 3
	for _, c := range visible {
		if d := editDistance(name, c); d < bestD {
			best, bestD = c, d
		}
	}
	if best != "" {
		return fmt.Errorf("unknown command %q; did you mean %q? (see qcowfs --help)", name, best)
	}
	return fmt.Errorf("unknown command %q (commands: %s; to mount, name an existing source: qcowfs mount SRC MNT)", name, strings.Join(visible, ", "))
}

// editDistance is the Damerau-Levenshtein distance of a and b (an
// adjacent swap, "inof" for "info", counts as one edit).
func editDistance(a, b string) int {
	d := make([][]int, len(a)+1)
	for i := range d {
		d[i] = make([]int, len(b)+1)
		d[i][0] = i
	}
	for j := range d[0] {
		d[0][j] = j
	}
	for i := 1; i <= len(a); i++ {
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			d[i][j] = min(d[i-1][j]+1, d[i][j-1]+1, d[i-1][j-1]+cost)
			if i > 1 && j > 1 && a[i-1] == b[j-2] && a[i-2] == b[j-1] {
				d[i][j] = min(d[i][j], d[i-2][j-2]+1)
			}
		}
	}
	return d[len(a)][len(b)]
}

// replacePrefixWord replaces the first whole-word occurrence of old in s.
func replacePrefixWord(s, old, new string) (string, bool) {
	for i := 0; ; {
		j := strings.Index(s[i:], old)
		if j < 0 {
			return s, false
		}
		j += i
		end := j + len(old)
		if end == len(s) || !isFlagChar(s[end]) {
			return s[:j] + new + s[end:], true
		}
		i = end
	}
}

func isFlagChar(c byte) bool {
	return c == '-' || c == '_' || 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9'
}
