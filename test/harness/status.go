package harness

// What the tests read of qcowfs status --output=json.

import (
	"encoding/json"
	"fmt"
	"regexp"
	"testing"
	"time"
)

// An OpenImage is one entry of the status's open images.
type OpenImage struct {
	Image          string `json:"image"`
	Handles        int    `json:"handles"`
	Writers        int    `json:"writers"`
	OpenForWriting bool   `json:"open-for-writing"`
	Locks          struct {
		Held      []string `json:"held"`
		NotShared []string `json:"not-shared"`
	} `json:"locks"`
	ReadRequests int64 `json:"read-requests"`
	ReadBytes    int64 `json:"read-bytes"`
	Errors
}

// Errors are the failed requests qcowfs status counts, of one image or of
// all.
type Errors struct {
	ReadErrors  int64 `json:"read-errors"`
	WriteErrors int64 `json:"write-errors"`
	LastError   *struct {
		Time   time.Time `json:"time"`
		Image  string    `json:"image"`
		Op     string    `json:"op"`
		Offset int64     `json:"offset"`
		Error  string    `json:"error"`
	} `json:"last-error"`
}

// RemoteStats are the remote client's counters of a remote mount.
type RemoteStats struct {
	Requests  int64       `json:"requests"`
	Bytes     int64       `json:"bytes"`
	Retries   int64       `json:"retries"`
	Errors    int64       `json:"errors"`
	Hydration []Hydration `json:"hydration"`
}

// Hydration is one remote file's hydration (--hydrate).
type Hydration struct {
	URL     string  `json:"url"`
	Needed  int64   `json:"needed"`
	Done    int64   `json:"done"`
	Fetched int64   `json:"fetched"`
	Percent float64 `json:"percent"`
	Rate    int64   `json:"rate"`
	State   string  `json:"state"`
	Error   string  `json:"error"`
}

// A Status is what the tests read of qcowfs status --output=json.
type Status struct {
	Writable bool   `json:"writable"`
	Overlay  string `json:"overlay"`
	// TempOverlay: Overlay is the folder of throwaway overlays
	// (--overlay=temp), removed at unmount.
	TempOverlay bool   `json:"temp-overlay"`
	CacheMode   string `json:"cache-mode"`
	// Offline: a remote image served from the disk cache alone.
	Offline bool `json:"offline"`
	Refused []struct{ Image, Reason, Hint string }
	// ReadOnly are the images a writable mount shows read-only.
	ReadOnly []struct{ Image, Reason string } `json:"read-only"`
	Images   struct {
		Open []OpenImage `json:"open-images"`
		Errors
		Remote *RemoteStats `json:"remote"` // nil but for a remote mount
	} `json:"images"`
}

// StatusOf runs qcowfs status --output=json on mnt and returns its answer,
// decoded and as printed; every key of it must be in one style,
// kebab-case (lower case letters and digits, words joined by "-").
func StatusOf(t testing.TB, mnt string) (Status, string) {
	t.Helper()
	r := Run(t, "status", "--output=json", mnt)
	WantOK(t, "qcowfs status --output=json", r)
	var st Status
	if err := json.Unmarshal([]byte(r.Stdout), &st); err != nil {
		t.Fatalf("qcowfs status --output=json: %v\n%s", err, r.Stdout)
	}
	var v any
	if err := json.Unmarshal([]byte(r.Stdout), &v); err != nil {
		t.Fatalf("not JSON: %v\n%s", err, r.Stdout)
	}
	kebab := regexp.MustCompile(`^[a-z0-9]+(-[a-z0-9]+)*$`)
	var walk func(path string, v any)
	walk = func(path string, v any) {
		switch v := v.(type) {
		case map[string]any:
			for k, x := range v {
				if !kebab.MatchString(k) {
					t.Errorf("qcowfs status --output=json: key %s.%s is not kebab-case", path, k)
				}
				walk(path+"."+k, x)
			}
		case []any:
			for i, x := range v {
				walk(fmt.Sprintf("%s[%d]", path, i), x)
			}
		}
	}
	walk("", v)
	return st, r.Stdout
}

// OpenEntry returns the open image img of st (its current state, not a
// snapshot: the test opens no snapshot), or nil.
func (st Status) OpenEntry(img string) *OpenImage {
	for i := range st.Images.Open {
		if st.Images.Open[i].Image == img {
			return &st.Images.Open[i]
		}
	}
	return nil
}
