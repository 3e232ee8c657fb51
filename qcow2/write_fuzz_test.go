package qcow2_test

import (
	"bytes"
	"encoding/binary"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/qcowfs/qcowfs/qcow2"
)

// FuzzWrite applies random sequences of writes, discards, zeroings,
// resizes and flushes to small images of every kind (plain, 512-byte
// clusters, snapshots, a backing chain, compressed, extended L2 over a
// backing file, a data file), checking the image against a raw model after
// every step. When the fuzzer runs, each input is also checked with the
// library's own Check; in the regular test run (the seed corpus and the
// inputs kept in testdata/fuzz), with qemu-img check and qemu-img convert.
func FuzzWrite(f *testing.F) {
	if _, err := exec.LookPath("qemu-img"); err != nil {
		f.Skip("qemu-img not installed")
	}
	dir := f.TempDir()
	if d, err := os.MkdirTemp("/dev/shm", "qcowfs-fuzzw"); err == nil {
		dir = d
		f.Cleanup(func() { os.RemoveAll(d) })
	}
	run := func(args ...string) {
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			f.Fatalf("%v: %v %s", args, err, out)
		}
	}
	img := func(name string, opts ...string) {
		run(append(append([]string{"qemu-img", "create", "-q", "-f", "qcow2"}, opts...), filepath.Join(dir, name), "2M")...)
	}
	img("plain.qcow2")
	img("small.qcow2", "-o", "cluster_size=512")
	img("snap.qcow2", "-o", "cluster_size=4096")
	run("qemu-io", "-f", "qcow2", "-c", "write -P 0x5 0 1M", filepath.Join(dir, "snap.qcow2"))
	run("qemu-img", "snapshot", "-c", "s", filepath.Join(dir, "snap.qcow2"))
	img("base.qcow2", "-o", "cluster_size=16384")
	run("qemu-io", "-f", "qcow2", "-c", "write -P 0x7 0 2M", filepath.Join(dir, "base.qcow2"))
	img("over.qcow2", "-b", "base.qcow2", "-F", "qcow2", "-o", "cluster_size=4096")
	img("ext.qcow2", "-b", "base.qcow2", "-F", "qcow2", "-o", "extended_l2=on,cluster_size=16384")
	run("qemu-img", "create", "-q", "-f", "raw", filepath.Join(dir, "c.raw"), "2M")
	run("qemu-io", "-f", "raw", "-c", "write -P 0x9 0 2M", filepath.Join(dir, "c.raw"))
	run("qemu-img", "convert", "-q", "-c", "-O", "qcow2", filepath.Join(dir, "c.raw"), filepath.Join(dir, "comp.qcow2"))
	img("df.qcow2", "-o", "data_file="+filepath.Join(dir, "df.data"))
	templates := []string{"plain", "small", "snap", "over", "ext", "comp", "df"}
	originals := map[string][]byte{}
	models := map[string][]byte{}
	for _, name := range templates {
		p := filepath.Join(dir, name+".qcow2")
		b, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		originals[name] = b
		raw := filepath.Join(dir, name+".model")
		run("qemu-img", "convert", "-O", "raw", p, raw)
		models[name], _ = os.ReadFile(raw)
	}
	dfOriginal, _ := os.ReadFile(filepath.Join(dir, "df.data"))

	for i := range templates {
		f.Add(byte(i), []byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20})
		f.Add(byte(i), []byte{1, 0, 0, 0, 255, 2, 0, 3, 0, 0, 4, 9, 9, 9, 0, 0, 4, 200, 1, 1})
	}
	fuzzing := flag.Lookup("test.fuzz") != nil && flag.Lookup("test.fuzz").Value.String() != ""
	f.Fuzz(func(t *testing.T, which byte, prog []byte) {
		name := templates[int(which)%len(templates)]
		work := filepath.Join(dir, name+".qcow2") // in place: backing and data file names resolve
		if err := os.WriteFile(work, originals[name], 0o644); err != nil {
			t.Fatal(err)
		}
		defer os.WriteFile(work, originals[name], 0o644)
		if name == "df" {
			os.WriteFile(filepath.Join(dir, "df.data"), dfOriginal, 0o644)
			defer os.WriteFile(filepath.Join(dir, "df.data"), dfOriginal, 0o644)
		}
		model := append([]byte(nil), models[name]...)
		wf, err := qcow2.OpenWritableFile(work)
		if err != nil {
			t.Fatal(err)
		}
		im, err := qcow2.NewImage(wf, qcow2.Options{Writable: true, Cache: qcow2.NewCache(256<<10, 256<<10)})
		if err != nil || !im.Writable() {
			t.Fatalf("open %s: %v %s", name, err, im.ReadOnlyReason())
		}
		// Each op is 5 bytes: kind, offset (16 bits, in 32 B units
		// modulo the size), length (16 bits, in bytes up to 64 KiB).
		for n := 0; n+5 <= len(prog) && n < 5*64; n += 5 {
			kind := prog[n] % 6
			size := int64(len(model))
			off := int64(binary.BigEndian.Uint16(prog[n+1:])) * 32 % size
			l := min(int64(binary.BigEndian.Uint16(prog[n+3:]))+1, size-off)
			var err error
			switch kind {
			case 0, 1:
				b := bytes.Repeat([]byte{byte(n/5 + 1)}, int(l))
				_, err = im.WriteAt(b, off)
				copy(model[off:], b)
			case 2:
				err = im.Discard(off, l)
				clear(model[off : off+l])
			case 3:
				err = im.WriteZeroes(off, l)
				clear(model[off : off+l])
			case 4:
				err = im.Flush()
			case 5:
				if size < 4<<20 {
					grow := (int64(prog[n+1])%8 + 1) * 65536
					err = im.Resize(size + grow)
					model = append(model, make([]byte, grow)...)
				}
			}
			if err != nil {
				t.Fatalf("%s op %d (kind %d, %d +%d): %v", name, n/5, kind, off, l, err)
			}
			got := make([]byte, min(l+4096, size-max(0, off-2048)))
			at := max(0, off-2048)
			if _, err := im.ReadAt(got, at); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, model[at:at+int64(len(got))]) {
				t.Fatalf("%s op %d (kind %d, %d +%d): the image reads differently from the model", name, n/5, kind, off, l)
			}
		}
		got := make([]byte, im.Size())
		if _, err := im.ReadAt(got, 0); err != nil || !bytes.Equal(got, model) {
			t.Fatalf("%s: the whole disk differs from the model (%v)", name, err)
		}
		if err := im.Close(); err != nil {
			t.Fatal(err)
		}
		if fuzzing {
			c, err := qcow2.Open(work, qcow2.Options{NoBacking: true, LenientTables: true})
			if err != nil {
				t.Fatal(err)
			}
			res, err := c.Check(nil)
			c.Close()
			if err != nil || res.Corruptions+res.Leaks+res.CheckErrors > 0 {
				t.Fatalf("%s: check: %v %+v %v", name, err, res, res.Messages)
			}
			return
		}
		out, err := exec.Command("qemu-img", "check", work).CombinedOutput()
		if err != nil {
			t.Fatalf("%s: qemu-img check: %v\n%s", name, err, out)
		}
		raw := filepath.Join(t.TempDir(), "after.raw")
		if out, err := exec.Command("qemu-img", "convert", "-O", "raw", work, raw).CombinedOutput(); err != nil {
			t.Fatalf("convert: %v %s", err, out)
		}
		if b, _ := os.ReadFile(raw); !bytes.Equal(b, model) {
			t.Fatalf("%s: qemu-img convert differs from the model", name)
		}
	})
}
