package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/qcowfs/qcowfs/fs"
	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/remote"
)

type statusCmd struct {
	Mountpoint string `arg:"" help:"Where qcowfs is mounted."`
	Output     string `enum:"human,json" default:"human" help:"Output format: human or json."`
}

func (c *statusCmd) Help() string {
	return `Examples:

  qcowfs status /mnt/vms
  qcowfs status --output=json /mnt/vms | jq .refused

The daemon answers on its control socket, /run/qcowfs/MNT.sock as root,
$XDG_RUNTIME_DIR/qcowfs/MNT.sock otherwise (MNT is the mount point escaped
as systemd-escape --path does), for its own user and root only.`
}

// mountStatus is what the daemon answers.
type mountStatus struct {
	Source     string    `json:"source"`
	Mountpoint string    `json:"mountpoint"`
	PID        int       `json:"pid"`
	Started    time.Time `json:"started"`
	Log        string    `json:"log"`
	Writable   bool      `json:"writable"`
	Overlay    string    `json:"overlay,omitempty"` // --overlay's folder
	// TempOverlay says the overlays are throwaway (--overlay=temp):
	// their folder goes at unmount.
	TempOverlay bool `json:"temp-overlay,omitempty"`
	// CacheMode is how a writable mount's buffered writes reach the
	// images: "writeback" (the kernel's writeback cache) or
	// "writethrough" (--no-writeback-cache).
	CacheMode string `json:"cache-mode,omitempty"`
	// Offline: a remote image served from the disk cache in CacheDir
	// alone (--offline).
	Offline  bool   `json:"offline,omitempty"`
	CacheDir string `json:"cache-dir,omitempty"`
	// Transport is how FUSE requests reach the daemon: "io_uring"
	// (--io-uring) or "/dev/fuse".
	Transport string    `json:"transport"`
	Refused   []refusal `json:"refused"`
	// ReadOnly are the images a writable mount shows read-only, and
	// why.
	ReadOnly []readOnlyImage `json:"read-only"`
	// Images is the tree's counters (fs.Status: the open images with
	// their handles and reads, the table cache, the remote client).
	Images any `json:"images,omitempty"`
}

type readOnlyImage struct {
	Image  string `json:"image"`
	Reason string `json:"reason"`
}

type refusal struct {
	Image  string `json:"image"`
	Reason string `json:"reason"`
	Hint   string `json:"hint,omitempty"`
}

// mountFacts are the mount-level facts the daemon knows from the start.
type mountFacts struct {
	Source, Mountpoint string
	PID                int
	Started            time.Time
	Log                string
	Writable           bool
	Overlay, CacheMode string
	Transport          string
	TempOverlay        bool
	Offline            bool
	CacheDir           string
	Hint               func(error) string // the flag that shows a refused image
}

// status builds the answer: the facts, the refused images, and stats (the
// tree's counters).
func (f mountFacts) status(refused refusalLister, readOnly readOnlyLister, stats func() any) mountStatus {
	s := mountStatus{Source: f.Source, Mountpoint: f.Mountpoint, PID: f.PID, Started: f.Started, Log: f.Log,
		Writable: f.Writable, Overlay: f.Overlay, TempOverlay: f.TempOverlay, CacheMode: f.CacheMode, Transport: f.Transport, Refused: []refusal{},
		Offline: f.Offline, CacheDir: f.CacheDir,
		ReadOnly: []readOnlyImage{}}
	if refused != nil {
		m := refused.Refused()
		for p, err := range m {
			// The image is named once, as in the log line.
			reason := strings.TrimPrefix(err.Error(), p+": ")
			s.Refused = append(s.Refused, refusal{Image: p, Reason: reason, Hint: f.Hint(err)})
		}
		sort.Slice(s.Refused, func(i, j int) bool { return s.Refused[i].Image < s.Refused[j].Image })
	}
	if readOnly != nil {
		for p, why := range readOnly.ReadOnly() {
			s.ReadOnly = append(s.ReadOnly, readOnlyImage{Image: p, Reason: why})
		}
		sort.Slice(s.ReadOnly, func(i, j int) bool { return s.ReadOnly[i].Image < s.ReadOnly[j].Image })
	}
	if stats != nil {
		s.Images = stats()
	}
	return s
}

func (c *statusCmd) Run() error {
	mnt, err := qcowfsMount(c.Mountpoint)
	if err != nil {
		return err
	}
	answer, err := askControl(mnt, "status")
	if err != nil {
		return err
	}
	if c.Output == "json" {
		var out bytes.Buffer
		if err := json.Indent(&out, bytes.TrimSpace(answer), "", "    "); err != nil {
			return fmt.Errorf("%s: the daemon's answer is not JSON: %w", c.Mountpoint, err)
		}
		fmt.Println(out.String())
		return nil
	}
	var s mountStatus
	var counters struct {
		Images *fs.Status `json:"images"`
	}
	if err := json.Unmarshal(answer, &s); err != nil {
		return fmt.Errorf("%s: the daemon's answer is not JSON: %w", c.Mountpoint, err)
	}
	if err := json.Unmarshal(answer, &counters); err != nil {
		return fmt.Errorf("%s: the daemon's answer has no counters qcowfs knows: %w", c.Mountpoint, err)
	}
	w := os.Stdout
	fmt.Fprintf(w, "source:      %s\n", s.Source)
	fmt.Fprintf(w, "mount point: %s\n", s.Mountpoint)
	fmt.Fprintf(w, "daemon:      pid %d, up since %s (%s)\n", s.PID, s.Started.Local().Format("2006-01-02 15:04:05"), time.Since(s.Started).Round(time.Second))
	fmt.Fprintf(w, "log:         %s\n", s.Log)
	fmt.Fprintf(w, "mode:        %s\n", s.mode())
	fmt.Fprintf(w, "transport:   %s\n", s.Transport)
	if st := counters.Images; st != nil {
		fmt.Fprintf(w, "errors:      %s\n", errorLine(st.ErrorCounts, true))
	}
	fmt.Fprintf(w, "not shown:   %s\n", plural(len(s.Refused), "image"))
	for _, r := range s.Refused {
		line := "  " + r.Reason
		if !strings.Contains(r.Reason, r.Image) {
			line = "  " + r.Image + ": " + r.Reason
		}
		if r.Hint != "" {
			line += " (" + r.Hint + ")"
		}
		fmt.Fprintln(w, line)
	}
	if s.Writable && s.Overlay == "" {
		fmt.Fprintf(w, "read-only:   %s\n", plural(len(s.ReadOnly), "image"))
		for _, r := range s.ReadOnly {
			fmt.Fprintf(w, "  %s: %s\n", r.Image, r.Reason)
		}
	}
	if st := counters.Images; st != nil {
		fmt.Fprintf(w, "open:        %s\n", plural(len(st.Images), "image"))
		for _, im := range st.Images {
			fmt.Fprintf(w, "  %s: %s, %s, %s\n", im.Image, plural(im.Handles, "handle"),
				plural(int(im.ReadRequests), "read"), plural(int(im.ReadBytes), "byte"))
			if im.Overlay != "" {
				fmt.Fprintf(w, "    overlay: %s\n", im.Overlay)
			}
			open := "open for reading"
			if im.OpenForWriting {
				open = fmt.Sprintf("open for writing (%s)", plural(im.Writers, "handle"))
			}
			fmt.Fprintf(w, "    %s; locks: %s\n", open, locksLine(im.Locks))
			fmt.Fprintf(w, "    errors: %s\n", errorLine(im.ErrorCounts, false))
		}
		if st.Remote != nil && len(st.Remote.Hydration) > 0 {
			fmt.Fprintf(w, "hydration:   %s\n", plural(len(st.Remote.Hydration), "file"))
			for _, h := range st.Remote.Hydration {
				fmt.Fprintf(w, "  %s\n", hydrationLine(h))
			}
		}
	}
	return nil
}

// hydrationLine says how far one hydration got: "https://h/vm.qcow2:
// running, 41.5% of 2.0 GiB (850.3 MiB fetched, 48.2 MiB/s)".
func hydrationLine(h remote.HydrationStatus) string {
	line := fmt.Sprintf("%s: %s, %.1f%% of %s (%s fetched, %s/s)", h.URL, h.State, h.Percent,
		mib(h.Needed), mib(h.Fetched), mib(h.Rate))
	if h.Error != "" {
		line += ": " + h.Error
	}
	return line
}

// mib shows a byte count in MiB (GiB from 1 GiB on), one decimal.
func mib(n int64) string {
	if n >= 1<<30 {
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	}
	return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
}

// mode says whether the mount writes, and how.
func (s *mountStatus) mode() string {
	m := "read-only"
	if s.Writable {
		m = "writable, " + s.CacheMode + " cache"
		if s.Overlay != "" {
			m += ", overlays in " + s.Overlay
			if s.TempOverlay {
				m += " (throwaway: removed at unmount)"
			}
		}
	}
	if s.Offline {
		m += "; offline: served from the disk cache " + s.CacheDir + " alone, what it lacks fails (EIO)"
	}
	return m
}

// locksLine says which of qemu's locks an image holds: "consistent
// read, write, resize; not sharing write, resize".
func locksLine(l qcow2.Locks) string {
	if len(l.Held) == 0 && len(l.NotShared) == 0 {
		return "none"
	}
	line := strings.Join(l.Held, ", ")
	if len(l.NotShared) > 0 {
		line += "; not sharing " + strings.Join(l.NotShared, ", ")
	}
	return line
}

// errorLine says how many reads and writes failed since the mount, and
// the last failure (of which image, if named): "1 read, 0 writes failed
// since mount; last: write of /srv/vm.qcow2 at 4096 (2026-12-04
// 15:04:05): ...".
func errorLine(c fs.ErrorCounts, named bool) string {
	line := fmt.Sprintf("%s, %s failed since mount", plural(int(c.ReadErrors), "read"), plural(int(c.WriteErrors), "write"))
	if e := c.LastError; e != nil {
		line += "; last: " + e.Op
		if named {
			line += " of " + e.Image
		}
		if e.Offset >= 0 {
			line += fmt.Sprintf(" at %d", e.Offset)
		}
		line += fmt.Sprintf(" (%s): %s", e.Time.Local().Format("2006-01-02 15:04:05"), e.Error)
	}
	return line
}

// plural says "1 image", "2 images".
func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}
