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
	Refused    []refusal `json:"refused"`
	// Images is the tree's counters (fs.Status: the open images with
	// their handles and reads, the table cache, the remote client).
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
	Hint               func(error) string // the flag that shows a refused image
}

// status builds the answer: the facts, the refused images, and stats (the
// tree's counters).
func (f mountFacts) status(refused refusalLister, stats func() any) mountStatus {
	s := mountStatus{Source: f.Source, Mountpoint: f.Mountpoint, PID: f.PID, Started: f.Started, Log: f.Log, Refused: []refusal{}}
	if refused != nil {
		m := refused.Refused()
		for p, err := range m {
			// The image is named once, as in the log line.
			reason := strings.TrimPrefix(err.Error(), p+": ")
			s.Refused = append(s.Refused, refusal{Image: p, Reason: reason, Hint: f.Hint(err)})
		}
		sort.Slice(s.Refused, func(i, j int) bool { return s.Refused[i].Image < s.Refused[j].Image })
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
	if st := counters.Images; st != nil {
		fmt.Fprintf(w, "open:        %s\n", plural(len(st.Images), "image"))
		for _, im := range st.Images {
			fmt.Fprintf(w, "  %s: %s, %s, %s\n", im.Image, plural(im.Handles, "handle"),
				plural(int(im.ReadRequests), "read"), plural(int(im.ReadBytes), "byte"))
		}
	}
	return nil
}

// plural says "1 image", "2 images".
func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}
