package hostile

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
	"github.com/qcowfs/qcowfs/test/qemu"
)

// TestCorruptCompressedCluster: a compressed cluster with a broken deflate
// stream, and one whose descriptor points past the end of the file, fail
// that read with EIO (qemu fails them too); the rest of the image and the
// other images of the mount read correctly, and the daemon logs the
// failure once per image.
func TestCorruptCompressedCluster(t *testing.T) {
	harness.RequireFUSE(t)
	src := qemu.TempDir(t)
	raw := filepath.Join(src, "text.raw")
	var text bytes.Buffer
	for i := 0; text.Len() < 4<<20; i++ {
		text.WriteString(strings.Repeat("qcowfs compressed cluster test line ", 3) + string(rune('a'+i%26)) + "\n")
	}
	os.WriteFile(raw, text.Bytes()[:4<<20], 0o644)
	const cs = 65536
	good := filepath.Join(src, "good.qcow2")
	qemu.Img(t, "convert", "-q", "-c", "-O", "qcow2", raw, good)
	pristine := qemu.ToRaw(t, good, filepath.Join(t.TempDir(), "pristine.raw"))

	// badstream: the compressed bytes of cluster 3 overwritten.
	bad := filepath.Join(src, "badstream.qcow2")
	qemu.Run(t, "cp", good, bad)
	_, e := qemu.L2EntryOffset(t, bad, 3)
	if e&(1<<62) == 0 {
		t.Fatalf("cluster 3 is not compressed: L2 entry %#x", e)
	}
	x := uint(62 - (16 - 8)) // cluster_bits 16
	coff := int64(e & (1<<x - 1))
	qemu.WriteAt(t, bad, coff, bytes.Repeat([]byte{0xff}, 64))

	// pasteof: cluster 3's descriptor points past the end of the file.
	past := filepath.Join(src, "pasteof.qcow2")
	qemu.Run(t, "cp", good, past)
	at, e := qemu.L2EntryOffset(t, past, 3)
	var nb [8]byte
	binary.BigEndian.PutUint64(nb[:], e&^(1<<x-1)|(1<<40))
	qemu.WriteAt(t, past, at, nb[:])

	// The oracle: qemu cannot read those clusters either.
	for _, p := range []string{bad, past} {
		out, _ := exec.Command("qemu-io", "-f", "qcow2", "-c", "read 196608 65536", p).CombinedOutput()
		if !strings.Contains(string(out), "Input/output error") {
			t.Fatalf("qemu-io reads the damaged cluster of %s: %s", p, out)
		}
	}

	m := harness.Mount(t, src)
	want, err := os.ReadFile(pristine)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"badstream", "pasteof"} {
		f, err := os.Open(filepath.Join(m.Dir, name+".raw"))
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, cs)
		for i := 0; i < 3; i++ {
			if _, err := f.ReadAt(buf[:4096], 3*cs+8192); !errors.Is(err, syscall.EIO) {
				t.Errorf("%s: reading the damaged cluster: %v, want EIO", name, err)
			}
		}
		for _, c := range []int64{0, 2, 4, 40} {
			if _, err := f.ReadAt(buf, c*cs); err != nil || !bytes.Equal(buf, want[c*cs:(c+1)*cs]) {
				t.Errorf("%s: cluster %d: %v, or bytes differ from qemu", name, c, err)
			}
		}
		f.Close()
		if n := harness.CountLines(m.LogText(t), name+".qcow2"); n != 1 {
			t.Errorf("want one log line for %s, got %d:\n%s", name, n, m.LogText(t))
		}
	}
	harness.SameFile(t, filepath.Join(m.Dir, "good.raw"), pristine)
}
