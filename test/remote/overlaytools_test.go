package remote

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
	"github.com/qcowfs/qcowfs/test/servers"
)

// TestRemoteOverlayTools: qcowfs info, info --backing-chain, map and
// check of overlays qcowfs made over images on nginx (one image, and one
// whose own backing file is on the server too) print what qemu-img
// prints of them, reading the bases over http with its curl driver, in
// both output formats: the backing file as its URL (no made-up local
// path), the chain through the server, the data clusters of each layer.
// qcowfs confines the remote part of a chain to the first remote file's
// folder, as it does for a URL given to it: with --allow-backing-outside
// a base in the folder above is followed too (info and check; qemu names
// it http://h/sub/../base.qcow2 where qcowfs resolves the URL). Before,
// info showed "actual path: OVERLAYS/http://..." and the others failed.
func TestRemoteOverlayTools(t *testing.T) {
	root := harness.SourceDir(t)
	makeBase(t, root)
	makeChain(t, root)
	flat := filepath.Join(root, "flat")
	if err := os.Mkdir(flat, 0o755); err != nil {
		t.Fatal(err)
	}
	qemu.Make(t, filepath.Join(flat, "base.qcow2"), "64M", "write -P 0x41 0 1M", "write -P 0x42 10M 3M")
	qemu.Create(t, "qcow2", filepath.Join(flat, "top.qcow2"), "64M", "-b", "base.qcow2", "-F", "qcow2")
	qemu.IO(t, filepath.Join(flat, "top.qcow2"), "write -P 0x43 512k 1M", "write -z 11M 64k")
	ng := servers.StartNginx(t, root, false)
	all := [][]string{
		{"info"}, {"info", "--output=json"}, {"info", "--backing-chain"}, {"info", "--backing-chain", "--output=json"},
		{"map"}, {"map", "--output=json"}, {"check"}, {"check", "--output=json"},
	}
	for _, c := range []struct {
		url, overlay string
		extra        []string
		cmds         [][]string
	}{
		{ng.URL + "/vm.qcow2", "vm.qcow2", nil, all},
		{ng.URL + "/flat/top.qcow2", "top.qcow2", nil, all},
		{ng.URL + "/sub/top.qcow2", "up/top.qcow2", []string{"--allow-backing-outside=" + ng.URL + "/"},
			[][]string{{"info"}, {"info", "--output=json"}, {"check"}, {"check", "--output=json"}}},
	} {
		ov := filepath.Join(t.TempDir(), filepath.Dir(c.overlay))
		m := mountRemote(t, harness.Daemon{}, c.url, append([]string{"--writable", "--overlay", ov}, c.extra...)...)
		writeThrough(t, filepath.Join(m.Dir, strings.TrimSuffix(filepath.Base(c.overlay), ".qcow2")+".raw"), overlayWrites[:5])
		m.Unmount(t)
		o := filepath.Join(ov, filepath.Base(c.overlay))
		for _, args := range c.cmds {
			what := strings.Join(args, " ") + " " + o
			q := curlOutput(t, append(args, o)...)
			us := harness.Run(t, append(append(args, c.extra...), o)...)
			if q.Code != 0 {
				t.Fatalf("qemu-img %s: exit %d\n%s", what, q.Code, q.Stderr)
			}
			qemu.SameOutput(t, what, "qcowfs: ", q, qemu.Output(us))
		}
	}
}

// curlOutput is qemu.ImgOutput of a run in which qemu reads a backing
// file over http: a run its curl driver hangs in is made again
// (curlQemu).
func curlOutput(t testing.TB, args ...string) qemu.Output {
	t.Helper()
	for range 3 {
		ctx, cancel := context.WithTimeout(context.Background(), curlTimeout)
		var stdout, stderr strings.Builder
		cmd := exec.CommandContext(ctx, "qemu-img", args...)
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		cmd.Run()
		hung := ctx.Err() != nil
		cancel()
		if !hung {
			return qemu.Output{Stdout: stdout.String(), Stderr: stderr.String(), Code: cmd.ProcessState.ExitCode()}
		}
		t.Logf("qemu-img %s: no answer in %v (qemu's curl driver hung); again", strings.Join(args, " "), curlTimeout)
	}
	t.Fatalf("qemu-img %s hung three times", strings.Join(args, " "))
	return qemu.Output{}
}
