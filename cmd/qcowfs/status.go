package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/qcowfs/qcowfs/internal/mountinfo"
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

// mountStatus is what the daemon answers. Images will carry the tree's
// per-image counters.
type mountStatus struct {
	Source     string    `json:"source"`
	Mountpoint string    `json:"mountpoint"`
	PID        int       `json:"pid"`
	Started    time.Time `json:"started"`
	Log        string    `json:"log"`
	Refused    []refusal `json:"refused"`
	// TODO(fs): per-image requests, bytes and cache hit rates, from a
	// Stats() any of the tree.
	Images any `json:"images,omitempty"`
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
}

// status builds the answer: the facts, the refused images, and stats (the
// tree's counters, nil for now).
func (f mountFacts) status(refused refusalLister, stats func() any) mountStatus {
	s := mountStatus{Source: f.Source, Mountpoint: f.Mountpoint, PID: f.PID, Started: f.Started, Log: f.Log, Refused: []refusal{}}
	if refused != nil {
		m := refused.Refused()
		for p, err := range m {
			s.Refused = append(s.Refused, refusal{Image: p, Reason: err.Error(), Hint: refusalHint(err)})
		}
		sort.Slice(s.Refused, func(i, j int) bool { return s.Refused[i].Image < s.Refused[j].Image })
	}
	if stats != nil {
		s.Images = stats()
	}
	return s
}

func (c *statusCmd) Run() error {
	mnt, err := filepath.Abs(c.Mountpoint)
	if err != nil {
		return err
	}
	if real, err := filepath.EvalSymlinks(mnt); err == nil {
		mnt = real
	}
	m, err := mountinfo.At(mnt)
	if err != nil {
		return err
	}
	if m == nil {
		return fmt.Errorf("%s: not mounted", c.Mountpoint)
	}
	if m.FSType != "fuse.qcowfs" {
		return fmt.Errorf("%s: a %s mount, not a qcowfs one", c.Mountpoint, m.FSType)
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
	if err := json.Unmarshal(answer, &s); err != nil {
		return fmt.Errorf("%s: the daemon's answer is not JSON: %w", c.Mountpoint, err)
	}
	w := os.Stdout
	fmt.Fprintf(w, "source:      %s\n", s.Source)
	fmt.Fprintf(w, "mount point: %s\n", s.Mountpoint)
	fmt.Fprintf(w, "daemon:      pid %d, up since %s (%s)\n", s.PID, s.Started.Local().Format("2006-01-02 15:04:05"), time.Since(s.Started).Round(time.Second))
	fmt.Fprintf(w, "log:         %s\n", s.Log)
	plural := "s"
	if len(s.Refused) == 1 {
		plural = ""
	}
	fmt.Fprintf(w, "not shown:   %d image%s\n", len(s.Refused), plural)
	for _, r := range s.Refused {
		line := "  " + r.Reason
		if r.Hint != "" {
			line += " (" + r.Hint + ")"
		}
		fmt.Fprintln(w, line)
	}
	return nil
}
