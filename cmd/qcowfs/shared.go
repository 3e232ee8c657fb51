package main

import (
	"fmt"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/qcowfs/qcowfs/internal/mountinfo"
	"github.com/qcowfs/qcowfs/internal/procinfo"
	"github.com/qcowfs/qcowfs/remote"
)

// sharedWriters says, one line each, which other qcowfs mounts have the
// source (or a folder holding it, or one inside it) mounted writable, by
// their mount table entries (fuse.qcowfs, per-mount option rw, the source
// as its fsname shows it): while one of them has an image open for
// writing, that image is busy in this mount (EBUSY, and not listed), and
// the other way round. The daemon is named where /proc tells
// (procinfo.FUSEServer).
func (c *mountCmd) sharedWriters() []string {
	if remote.IsURL(c.Source) {
		return nil
	}
	mounts, err := mountinfo.Read()
	if err != nil {
		return nil
	}
	src := realPath(c.Source)
	var lines []string
	for _, m := range mounts {
		if m.FSType != "fuse.qcowfs" || !strings.HasPrefix(m.Options+",", "rw,") || !filepath.IsAbs(m.Source) {
			continue
		}
		other := realPath(m.Source)
		if !within(src, other) && !within(other, src) {
			continue
		}
		who := "another qcowfs (mounted at " + m.Point + ")"
		if _, minor, ok := strings.Cut(m.MajMin, ":"); ok && strings.HasPrefix(m.MajMin, "0:") {
			if conn, err := strconv.Atoi(minor); err == nil {
				if p, ok := procinfo.FUSEServer(conn); ok && p.Mount != "" {
					who = p.String()
				}
			}
		}
		lines = append(lines, fmt.Sprintf("%s is already mounted writable by %s: an image one of them has open for writing is busy (EBUSY) in the other", m.Source, who))
	}
	return lines
}
