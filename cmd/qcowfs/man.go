package main

import (
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/alecthomas/kong"
)

// manCmd prints the qcowfs(1) man page, made from the same kong model
// that parses the command line, so that the page cannot drift from
// --help. make install runs it (go run ./cmd/qcowfs help-man).
type manCmd struct{}

func (manCmd) Run(k *kong.Kong) error {
	return writeMan(os.Stdout, k.Model)
}

func writeMan(w io.Writer, app *kong.Application) error {
	p := func(format string, args ...any) { fmt.Fprintf(w, format+"\n", args...) }
	p(`.TH QCOWFS 1 "" "qcowfs %s" "User Commands"`, roff(version))
	p(".SH NAME")
	p(`qcowfs \- show QEMU qcow2 disk images as raw disk files (FUSE)`)
	p(".SH SYNOPSIS")
	for _, n := range app.Children {
		if n.Hidden {
			continue
		}
		p(`\fBqcowfs %s\fR`, roff(n.Summary()))
		p(".br")
	}
	p(".SH DESCRIPTION")
	paragraphs(w, description)
	p(".SH COMMANDS")
	for _, n := range app.Children {
		if n.Hidden {
			continue
		}
		p(".SS %q", roff("qcowfs "+n.Summary()))
		paragraphs(w, n.Help)
		for _, a := range n.Positional {
			p(".TP")
			p(`\fI%s\fR`, roff(strings.ToUpper(a.Name)))
			p("%s", roff(a.Help))
		}
		for _, f := range n.Flags {
			if f.Hidden {
				continue
			}
			p(".TP")
			p(`\fB%s\fR`, roff(f.String()))
			help := f.Help
			if f.HasDefault && !strings.Contains(help, "default") {
				help += " (default: " + f.Default + ")"
			}
			p("%s", roff(help))
		}
		if n.Detail != "" {
			paragraphs(w, n.Detail)
		}
	}
	p(".SH FILES")
	p(".TP")
	p(`\fI/run/qcowfs/MNT.log\fR, \fI$XDG_RUNTIME_DIR/qcowfs/MNT.log\fR`)
	p("The daemon's log when there is no syslog and no --log-file (MNT is the mount point escaped as systemd-escape --path does).")
	p(".TP")
	p(`\fI/run/qcowfs/MNT.sock\fR, \fI$XDG_RUNTIME_DIR/qcowfs/MNT.sock\fR`)
	p("The control socket that qcowfs status asks.")
	p(".SH SEE ALSO")
	p(`\fBqemu-img\fR(1), \fBmount\fR(8), \fBfstab\fR(5), \fBmount.fuse3\fR(8), \fBfusermount3\fR(1)`)
	return nil
}

// paragraphs writes text as roff paragraphs: lines indented by two or
// more spaces are kept as they are (examples), the rest is filled.
func paragraphs(w io.Writer, text string) {
	for _, para := range strings.Split(strings.TrimSpace(text), "\n\n") {
		lines := strings.Split(para, "\n")
		if strings.HasPrefix(lines[0], "  ") {
			fmt.Fprintln(w, ".PP\n.nf")
			for _, l := range lines {
				fmt.Fprintln(w, roff(l))
			}
			fmt.Fprintln(w, ".fi")
			continue
		}
		fmt.Fprintln(w, ".PP")
		fmt.Fprintln(w, roff(strings.Join(lines, " ")))
	}
}

// roff escapes text for a roff line: backslashes, and a leading dot or
// quote that would start a request.
func roff(s string) string {
	s = strings.ReplaceAll(s, `\`, `\e`)
	s = strings.ReplaceAll(s, "-", `\-`)
	if strings.HasPrefix(s, ".") || strings.HasPrefix(s, "'") {
		s = `\&` + s
	}
	return s
}
