package ext4

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestDxHash compares the directory hash of names of many lengths (each
// side of the 16- and 32-byte chunks the hashes work in, and bytes past
// 0x7f, which signed and unsigned chars hash differently) in every hash
// version, with and without a seed, with e2fsprogs' (debugfs dx_hash).
func TestDxHash(t *testing.T) {
	requireTools(t, "debugfs")
	names := []string{"a", "ab", "abc", "abcd", "hello", "éé", "\xff\xfe\x80", strings.Repeat("x", 15), strings.Repeat("y", 16),
		strings.Repeat("z", 17), strings.Repeat("é", 15) + "x", strings.Repeat("q", 32), strings.Repeat("w", 33), strings.Repeat("ü", 100), strings.Repeat("n", 255)}
	seeds := []string{"", "9b5ffb33-8a13-4d3d-9b1f-4fbf4d4e4c2a"}
	var cmds strings.Builder
	type query struct {
		name    string
		version int
		seed    [4]uint32
	}
	var queries []query
	for _, seed := range seeds {
		var words [4]uint32
		flag := ""
		if seed != "" {
			b, err := hex.DecodeString(strings.ReplaceAll(seed, "-", ""))
			if err != nil {
				t.Fatal(err)
			}
			for i := range words {
				words[i] = binary.LittleEndian.Uint32(b[4*i:])
			}
			flag = "-s " + seed + " "
		}
		for v := hashLegacy; v <= hashTeaUnsigned; v++ {
			for _, n := range names {
				fmt.Fprintf(&cmds, "dx_hash -h %d %s%s\n", v, flag, n)
				queries = append(queries, query{n, v, words})
			}
		}
	}
	file := filepath.Join(t.TempDir(), "cmds")
	if err := os.WriteFile(file, []byte(cmds.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	var answers []string
	for _, line := range strings.Split(command(t, "debugfs", "-f", file), "\n") {
		if strings.HasPrefix(line, "Hash of ") {
			answers = append(answers, line)
		}
	}
	if len(answers) != len(queries) {
		t.Fatalf("debugfs answered %d of %d", len(answers), len(queries))
	}
	for i, q := range queries {
		h, m := dxHash([]byte(q.name), q.version, q.seed)
		want := answers[i]
		got := fmt.Sprintf("Hash of %s is 0x%x (minor 0x%x)", q.name, h, m)
		if got != want {
			t.Errorf("version %d, seed %x: %q, debugfs says %q", q.version, q.seed, got, want)
		}
	}
}
