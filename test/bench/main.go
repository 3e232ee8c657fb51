// Command bench measures qcowfs against the other ways of serving a qcow2
// image as a raw file: every contestant on the same work, interleaved, in
// one run, reported as medians and ratios with the machine and the date.
//
//	go run ./test/bench            # the full suite (make bench): docs/benchmarks.md
//	go run ./test/bench --quick    # a subset in under 3 minutes (make bench-quick)
//	go run ./test/bench --ref 813bc8e --only dd-,w-   # with qcowfs built from another revision
//
// It needs root (FUSE, loop devices, dropping caches). The test images are
// built once into the work folder and kept. One file per concept:
//
//   - workloads.go, writes.go, remote.go: the workloads, as a table of data
//   - contestants.go: who takes part, and how each serves an image
//   - run.go: the one run loop, and one run of one contestant
//   - targets.go: a run's image, mount and variables; env.go: commands,
//     cleanup; images.go: the test images; remote.go: the servers
//   - report.go, machine.go: statistics, the report and its raw numbers
//
// A workload is a row of data: its image, its contestants, a bash command
// on $FILE (and commands of their own for contestants without a mount),
// what runs untimed before and after, its check, its metrics. A contestant
// is a row of contestants: a function that mounts an image for one run, or
// none if the workloads give its commands. So, for example:
//
//   - another build of qcowfs: --ref REV;
//   - qcowfs with other options: a row with flags, as qcowfs-nowb;
//   - encrypted images: workloads.go's encrypted rows, the "enc" image,
//     $KEY given to both mounts (--key-file; --object secret and
//     encrypt.key-secret), the clear contestants on the same data unencrypted;
//   - remote overlays: a workload with remote and fresh, its contestants'
//     mounts given --overlay.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"
)

type config struct {
	quick      bool
	runs       int // rounds
	work, bin  string
	report     string
	build      bool
	only, skip []string
	refs       []string // git revisions of qcowfs to measure beside it
	fioTime    time.Duration
	list       bool
}

func main() {
	var cfg config
	var only, skip, refs string
	repo := first(1, "git", "rev-parse", "--show-toplevel")
	work := os.Getenv("QCOWFS_BENCH_WORK")
	if work == "" {
		work = filepath.Join(repo, ".work", "bench")
	}
	flag.BoolVar(&cfg.quick, "quick", false, "run the quick subset")
	flag.IntVar(&cfg.runs, "runs", 0, "rounds: runs per contestant (default 3, --quick 2)")
	flag.StringVar(&cfg.work, "work", work, "work folder: the images, runs, logs ($QCOWFS_BENCH_WORK)")
	flag.StringVar(&cfg.bin, "bin", filepath.Join(repo, "bin", "qcowfs"), "the qcowfs binary to measure")
	flag.BoolVar(&cfg.build, "build", true, "run `make build` first")
	flag.StringVar(&cfg.report, "report", "", "the report to write (default docs/benchmarks.md; --quick: WORK/quick/benchmarks.md)")
	flag.StringVar(&only, "only", "", "comma-separated workload ids or prefixes to run (dd-,w-)")
	flag.StringVar(&skip, "skip", "", "comma-separated workload ids or prefixes to leave out (r- for the remote ones)")
	flag.StringVar(&refs, "ref", "", "comma-separated git revisions: qcowfs built from each is a contestant too")
	flag.DurationVar(&cfg.fioTime, "fio-time", 3*time.Second, "fio's run time")
	flag.BoolVar(&cfg.list, "list", false, "list the workloads and stop")
	flag.Parse()
	split := func(s string) []string { return strings.FieldsFunc(s, func(r rune) bool { return r == ',' }) }
	cfg.only, cfg.skip, cfg.refs = split(only), split(skip), split(refs)
	if cfg.runs == 0 {
		cfg.runs = 3
		if cfg.quick {
			cfg.runs = 2
		}
	}
	if cfg.report == "" {
		cfg.report = filepath.Join(repo, "docs", "benchmarks.md")
		if cfg.quick {
			cfg.report = filepath.Join(cfg.work, "quick", "benchmarks.md")
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	defer stop()
	if err := bench(ctx, cfg, repo); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// suite is the workloads cfg selects, in the order they run.
func suite(cfg config) []*workload {
	match := func(id string, prefixes []string) bool {
		return slices.ContainsFunc(prefixes, func(p string) bool { return strings.HasPrefix(id, p) })
	}
	var ws []*workload
	for _, w := range slices.Concat(readWorkloads(), writeWorkloads(), encryptedWorkloads(), remoteWorkloads()) {
		if cfg.quick && w.quick != nil {
			w.who = w.quick
		}
		if (!cfg.quick || w.quick != nil) && (len(cfg.only) == 0 || match(w.id, cfg.only)) && !match(w.id, cfg.skip) {
			ws = append(ws, w)
		}
	}
	return ws
}

func bench(ctx context.Context, cfg config, repo string) error {
	ws := suite(cfg)
	if cfg.list || len(ws) == 0 {
		for _, w := range ws {
			fmt.Printf("%-24s %s\n", w.id, w.title)
		}
		if len(ws) == 0 {
			return fmt.Errorf("no workload matches")
		}
		return nil
	}
	if os.Geteuid() != 0 {
		return fmt.Errorf("needs root: FUSE mounts, loop devices, dropping caches")
	}
	restore, uring := uringOn()
	defer restore()
	fmt.Println(uring)
	start := time.Now()
	e, err := newEnv(ctx, cfg)
	if err != nil {
		return err
	}
	defer e.close()
	bin, version, err := qcowfsUnderTest(e, repo)
	if err != nil {
		return err
	}
	cast := map[string]*contestant{}
	for _, c := range contestants(bin) {
		cast[c.id] = c
	}
	var refs []*contestant
	for _, rev := range cfg.refs {
		c, err := buildRef(e, repo, rev)
		if err != nil {
			return err
		}
		refs = append(refs, c)
	}
	for _, w := range ws {
		if w.image != "" {
			if err := e.build(w.image); err != nil {
				return err
			}
		}
	}
	lineup := func(w *workload) []*contestant {
		var cs []*contestant
		for _, id := range w.who {
			cs = append(cs, cast[id])
			if id == "qcowfs" {
				cs = append(cs, refs...)
			}
		}
		return cs
	}
	m := describeMachine(version)
	load := loadWatch()
	prepare := func(w *workload) error {
		if w.prepare == nil {
			return nil
		}
		return w.prepare(e)
	}
	rs := runAll(ctx, ws, lineup, cfg.runs, prepare, e.measure, os.Stdout)
	m.Load = load()
	if ctx.Err() != nil {
		return fmt.Errorf("interrupted: no report written")
	}
	took := time.Since(start)
	if err := os.MkdirAll(filepath.Dir(cfg.report), 0o755); err != nil {
		return err
	}
	if err := writeReport(cfg.report, rs, refs, m, cfg.runs, took); err != nil {
		return err
	}
	fmt.Printf("\n%s\nreport: %s; took %s\n", summary(rs, refs), cfg.report, took.Round(time.Second))
	return nil
}

// qcowfsUnderTest builds qcowfs (make build) and measures a copy of it, so
// that a rebuild during the run does not change what is measured.
func qcowfsUnderTest(e *env, repo string) (bin, version string, err error) {
	if e.cfg.build {
		if _, err := e.sh(`make -C "$R" build`, "R="+repo); err != nil {
			return "", "", err
		}
	}
	bin = filepath.Join(e.cfg.work, "bin", "qcowfs")
	if _, err := e.sh(`mkdir -p "$(dirname "$B")" && cp "$S" "$B.new" && mv "$B.new" "$B"`, "S="+e.cfg.bin, "B="+bin); err != nil {
		return "", "", err
	}
	return bin, first(2, bin, "version"), nil
}

// buildRef builds qcowfs at git revision rev in a temporary worktree (once:
// the binary is kept under its commit's name).
func buildRef(e *env, repo, rev string) (*contestant, error) {
	commit, err := exec.Command("git", "-C", repo, "rev-parse", "--short", rev+"^{commit}").Output()
	if err != nil {
		return nil, fmt.Errorf("--ref %s: not a commit", rev)
	}
	bin := filepath.Join(e.cfg.work, "bin", "qcowfs-"+strings.TrimSpace(string(commit)))
	if !exists(bin) {
		fmt.Printf("building qcowfs %s\n", rev)
		_, err = e.sh(`d=$(mktemp -d); trap 'git -C "$R" worktree remove --force "$d"' EXIT
git -C "$R" worktree add -q --detach "$d" "$REV"
cd "$d" && go build -ldflags "-X main.version=$REV" -o "$B" ./cmd/qcowfs`, "R="+repo, "REV="+rev, "B="+bin)
		if err != nil {
			return nil, fmt.Errorf("building --ref %s: %w", rev, err)
		}
	}
	return refContestant(rev, bin), nil
}
