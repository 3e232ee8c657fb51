package main

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"

	"github.com/qcowfs/qcowfs/internal/mountinfo"
)

// machineInfo describes where the numbers were measured.
type machineInfo struct {
	CPU       string `json:"cpu"`
	Cores     int    `json:"cores"`
	RAM       string `json:"ram"`
	Kernel    string `json:"kernel"`
	WorkFS    string `json:"work_fs"`
	Qemu      string `json:"qemu"`
	QemuSD    string `json:"qemu_storage_daemon"`
	Libqcow   string `json:"libqcow"`
	Fio       string `json:"fio"`
	Coreutils string `json:"coreutils"`
	Strace    string `json:"strace"`
	Qcowfs    string `json:"qcowfs"`
	Drop      string `json:"drop_caches"`
}

func (b *bench) machine() machineInfo {
	m := machineInfo{Cores: runtime.NumCPU(), Qcowfs: b.qcowfsVersion}
	if data, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(data), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPU = strings.TrimSpace(v)
				break
			}
		}
	}
	if data, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, line := range strings.Split(string(data), "\n") {
			if v, ok := strings.CutPrefix(line, "MemTotal:"); ok {
				f := strings.Fields(v)
				if kb, err := strconv.ParseInt(f[0], 10, 64); err == nil {
					m.RAM = humanBytes(kb << 10)
				}
			}
		}
	}
	if data, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = strings.TrimSpace(string(data))
	}
	var best mountinfo.Mount
	for _, mt := range mounts() {
		if (b.cfg.work == mt.Point || strings.HasPrefix(b.cfg.work+"/", strings.TrimSuffix(mt.Point, "/")+"/")) && len(mt.Point) >= len(best.Point) {
			best = mt
		}
	}
	m.WorkFS = fmt.Sprintf("%s on %s (%s, mounted at %s)", b.cfg.work, best.FSType, best.Source, best.Point)
	first := func(name string, args ...string) string {
		out, _ := exec.Command(name, args...).CombinedOutput()
		for _, line := range strings.Split(string(out), "\n") {
			if s := strings.TrimSpace(line); s != "" {
				return s
			}
		}
		return "not installed"
	}
	m.Qemu = first("qemu-img", "--version")
	m.QemuSD = first("qemu-storage-daemon", "--version")
	m.Libqcow = first("qcowmount", "-V")
	m.Fio = first("fio", "--version")
	m.Coreutils = first("cp", "--version")
	m.Strace = first("strace", "-V")
	if b.canDrop {
		m.Drop = "yes: `sync; echo 3 > /proc/sys/vm/drop_caches` before every cold read, copy and guest read"
	} else {
		m.Drop = "no (" + b.dropWhy + "): cold rows are first reads after a sync, with whatever the page cache holds"
	}
	return m
}
