package main

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"
)

// machine says where and when the numbers were measured.
type machine struct {
	Date     string   `json:"date"`
	CPU      string   `json:"cpu"`
	Cores    int      `json:"cores"`
	RAM      string   `json:"ram"`
	Kernel   string   `json:"kernel"`
	Versions []string `json:"versions"` // qcowfs, qemu, libqcow, fio, ...
	Load     string   `json:"load"`     // the 1-minute load average: before, highest during, after
}

// first is the first n words of a file or of a command's output.
func first(n int, name string, args ...string) string {
	var b []byte
	if len(args) == 0 {
		b, _ = os.ReadFile(name)
	} else {
		b, _ = exec.Command(name, args...).CombinedOutput()
	}
	f := strings.Fields(string(b))
	return strings.Join(f[:min(len(f), n)], " ")
}

// field is the value of the first "key: value" line of a /proc file.
func field(file, key string) string {
	b, _ := os.ReadFile(file)
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == key {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

func describeMachine(qcowfs string) machine {
	kb, _ := strconv.ParseInt(strings.TrimSuffix(field("/proc/meminfo", "MemTotal"), " kB"), 10, 64)
	return machine{
		Date:   time.Now().UTC().Format("2006-01-02 15:04 UTC"),
		CPU:    field("/proc/cpuinfo", "model name"),
		Cores:  runtime.NumCPU(),
		RAM:    fmt.Sprintf("%.1f GiB", float64(kb)/(1<<20)),
		Kernel: first(1, "/proc/sys/kernel/osrelease"),
		Versions: []string{qcowfs, first(3, "qemu-img", "--version"), first(2, "qcowmount", "-V"), first(1, "fio", "--version"),
			first(3, "nginx", "-v"), first(2, "curl", "--version"), runtime.Version()},
	}
}

// loadWatch samples the 1-minute load average every 10 s until stop is
// called, which returns "before, highest, after".
func loadWatch() (stop func() string) {
	load := func() float64 {
		v, _ := strconv.ParseFloat(first(1, "/proc/loadavg"), 64)
		return v
	}
	var mu sync.Mutex
	before, high := load(), load()
	done := make(chan struct{})
	go func() {
		for t := time.NewTicker(10 * time.Second); ; {
			select {
			case <-done:
				return
			case <-t.C:
				mu.Lock()
				high = max(high, load())
				mu.Unlock()
			}
		}
	}()
	return func() string {
		close(done)
		mu.Lock()
		defer mu.Unlock()
		return fmt.Sprintf("%.1f before, up to %.1f during, %.1f after", before, high, load())
	}
}

func (m machine) markdown(rounds int, took time.Duration) string {
	return fmt.Sprintf("| | |\n| --- | --- |\n| date | %s |\n| took | %s, %d rounds |\n| machine | %s, %d cores, %s RAM, kernel %s |\n"+
		"| 1-minute load average | %s (%d cores) |\n| versions | %s |\n",
		m.Date, took.Round(time.Second), rounds, m.CPU, m.Cores, m.RAM, m.Kernel, m.Load, m.Cores, strings.Join(m.Versions, "; "))
}
