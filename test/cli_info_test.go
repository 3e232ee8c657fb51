package test

// Command line tests: qcowfs info against qemu-img info.

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"

	"github.com/qcowfs/qcowfs/test/qemu"
)

// cliCompareJSON compares qcowfs's decoded JSON with qemu's, recursively,
// on the keys qemu prints, and reports keys only qcowfs prints.
func cliCompareJSON(t *testing.T, path string, got, want map[string]any) {
	t.Helper()
	for k, w := range want {
		g, ok := got[k]
		if !ok {
			// qemu 8.0 and later print "children", the image's
			// protocol-level nodes (the file it lives in); qcowfs
			// describes the image only. qemu 7.2 does not print it.
			if k == "children" {
				continue
			}
			t.Errorf("%s: qcowfs info lacks %q (qemu-img: %v)", path, k, w)
			continue
		}
		wm, wok := w.(map[string]any)
		gm, gok := g.(map[string]any)
		if wok && gok {
			cliCompareJSON(t, path+"/"+k, gm, wm)
			continue
		}
		if !reflect.DeepEqual(g, w) {
			t.Errorf("%s: %q is %#v, qemu-img says %#v", path, k, g, w)
		}
	}
	for k, g := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("%s: qcowfs info prints %q (%v), qemu-img does not", path, k, g)
		}
	}
}

// cliInfoJSON runs "qcowfs info --output=json" in dir (if not empty).
func cliInfoJSON(t *testing.T, dir, image string) map[string]any {
	t.Helper()
	cmd := exec.Command(qcowfsBin, "info", "--output=json", image)
	cmd.Dir = dir
	r := cliRunCmd(t, cmd)
	cliWantOK(t, "qcowfs info --output=json "+image, r)
	var m map[string]any
	if err := json.Unmarshal([]byte(r.stdout), &m); err != nil {
		t.Fatalf("qcowfs info --output=json %s: %v\n%s", image, err, r.stdout)
	}
	return m
}

// cliQemuInfo runs qemu-img info with format "json" or "human" in dir.
func cliQemuInfo(t *testing.T, dir, format, image string) string {
	t.Helper()
	cmd := exec.Command("qemu-img", "info", "--output="+format, image)
	cmd.Dir = dir
	r := cliRunCmd(t, cmd)
	if r.code != 0 {
		t.Fatalf("qemu-img info %s: %s", image, r.stderr)
	}
	return r.stdout
}

// cliSetIncompat sets bits of a qcow2 header's incompatible features
// (bytes 72-79, big-endian): 1 is dirty, 2 is corrupt. qemu-img info then
// says what it makes of the result.
func cliSetIncompat(t *testing.T, path string, bits byte) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var b [1]byte
	if _, err := f.ReadAt(b[:], 79); err != nil {
		t.Fatal(err)
	}
	b[0] |= bits
	if _, err := f.WriteAt(b[:], 79); err != nil {
		t.Fatal(err)
	}
}

// TestInfoMatchesQemu: "qcowfs info" says what "qemu-img info" says, in
// JSON for every image of the matrix and a few more, and line for line in
// the human format for some.
func TestInfoMatchesQemu(t *testing.T) {
	qemu.Require(t, "qemu-img", "qemu-io")
	dir := qemu.TempDir(t)
	images := qemu.Matrix(t, dir)

	// Header bits qemu-img info reports: dirty (v3 with lazy refcounts)
	// and corrupt.
	dirty := filepath.Join(dir, "dirty.qcow2")
	qemu.Create(t, "qcow2", dirty, "1M", "-o", "lazy_refcounts=on")
	qemu.IO(t, dirty, "write -P 0x12 0 4k")
	cliSetIncompat(t, dirty, 1)
	corrupt := filepath.Join(dir, "corrupt.qcow2")
	qemu.Create(t, "qcow2", corrupt, "1M")
	qemu.IO(t, corrupt, "write -P 0x12 0 4k")
	cliSetIncompat(t, corrupt, 2)
	// Other compression, refcount width and an absolute backing name.
	zstd := filepath.Join(dir, "zstd.qcow2")
	qemu.Create(t, "qcow2", zstd, "3M", "-o", "compression_type=zstd,refcount_bits=1,extended_l2=on,cluster_size=16384", "-b", images[0].Path, "-F", "qcow2")
	images = append(images, qemu.Image{Name: "dirty", Path: dirty}, qemu.Image{Name: "corrupt", Path: corrupt}, qemu.Image{Name: "zstd", Path: zstd})

	for _, im := range images {
		t.Run("json/"+im.Name, func(t *testing.T) {
			var want map[string]any
			if err := json.Unmarshal([]byte(cliQemuInfo(t, "", "json", im.Path)), &want); err != nil {
				t.Fatal(err)
			}
			cliCompareJSON(t, im.Name, cliInfoJSON(t, "", im.Path), want)
		})
	}

	// Relative names: "filename" and "full-backing-filename" are what
	// qemu-img makes of the name it is given.
	t.Run("json/relative", func(t *testing.T) {
		for _, name := range []string{"chain-top.qcow2", "./chain-mid.qcow2"} {
			var want map[string]any
			if err := json.Unmarshal([]byte(cliQemuInfo(t, dir, "json", name)), &want); err != nil {
				t.Fatal(err)
			}
			cliCompareJSON(t, name, cliInfoJSON(t, dir, name), want)
		}
	})

	human := map[string]bool{"v2-c512": true, "v3-c65536": true, "compressed-c4096": true,
		"chain-top": true, "over-compressed": true, "prealloc": true, "dirty": true, "corrupt": true, "zstd": true,
		"datafile-raw-on": true, "datafile-raw-off": true}
	for _, im := range images {
		if !human[im.Name] {
			continue
		}
		t.Run("human/"+im.Name, func(t *testing.T) {
			want := strings.Split(strings.TrimSuffix(cliQemuInfo(t, "", "human", im.Path), "\n"), "\n")
			r := cliRun(t, "info", im.Path)
			cliWantOK(t, "qcowfs info", r)
			got := strings.Split(strings.TrimSuffix(r.stdout, "\n"), "\n")
			if missing, extra := cliLineDiff(got, want); len(missing)+len(extra) > 0 {
				t.Errorf("qcowfs info %s differs from qemu-img info:\nonly qemu-img: %q\nonly qcowfs:   %q", im.Path, missing, extra)
			}
		})
	}

	// qemu-img info does not open the backing file, so it describes an
	// overlay whose backing file is gone.
	t.Run("json/missing_backing", func(t *testing.T) {
		d := t.TempDir()
		base := filepath.Join(d, "base.qcow2")
		over := filepath.Join(d, "over.qcow2")
		qemu.Create(t, "qcow2", base, "1M")
		qemu.Create(t, "qcow2", over, "1M", "-b", "base.qcow2", "-F", "qcow2")
		os.Remove(base)
		var want map[string]any
		if err := json.Unmarshal([]byte(cliQemuInfo(t, "", "json", over)), &want); err != nil {
			t.Fatal(err)
		}
		r := cliRun(t, "info", "--output=json", over)
		cliWantOK(t, "qcowfs info (missing backing file)", r)
		var got map[string]any
		if err := json.Unmarshal([]byte(r.stdout), &got); err != nil {
			t.Fatal(err)
		}
		cliCompareJSON(t, "over", got, want)
	})
}

// cliLineDiff returns the lines only in want and only in got, as sets.
func cliLineDiff(got, want []string) (missing, extra []string) {
	count := map[string]int{}
	for _, l := range want {
		count[l]++
	}
	for _, l := range got {
		count[l]--
	}
	for l, n := range count {
		for ; n > 0; n-- {
			missing = append(missing, l)
		}
		for ; n < 0; n++ {
			extra = append(extra, l)
		}
	}
	sort.Strings(missing)
	sort.Strings(extra)
	return missing, extra
}

// TestInfoErrors: info on something that is not an image says why in one
// line and fails.
func TestInfoErrors(t *testing.T) {
	dir := t.TempDir()
	notImage := cliWrite(t, filepath.Join(dir, "notimage.qcow2"), strings.Repeat("not a qcow2 image\n", 1000))
	empty := cliWrite(t, filepath.Join(dir, "empty.qcow2"), "")
	missing := filepath.Join(dir, "nosuch.qcow2")
	// Encrypted images are refused with the encryption method named.
	luks := filepath.Join(dir, "luks.qcow2")
	aes := filepath.Join(dir, "aes.qcow2")
	qemu.CreateEncrypted(t, luks, "luks")
	qemu.CreateEncrypted(t, aes, "aes")
	for _, c := range []struct {
		path  string
		words []string
	}{
		{notImage, []string{notImage, "not a qcow2 image"}},
		{empty, []string{empty}},
		{missing, []string{missing, "no such file"}},
		{dir, []string{dir}},
		{luks, []string{luks, "encrypted (luks): not supported"}},
		{aes, []string{aes, "encrypted (aes): not supported"}},
	} {
		for _, format := range []string{"human", "json"} {
			r := cliRun(t, "info", "--output="+format, c.path)
			cliWantError(t, "qcowfs info --output="+format+" "+c.path, r, c.words...)
		}
	}
}
