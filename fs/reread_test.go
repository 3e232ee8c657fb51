package fs

import "testing"

// TestHoleWatch: which read patterns drop the page cache ahead (reread.go).
func TestHoleWatch(t *testing.T) {
	type read struct{ off, n int64 }
	seq := func(start, step, n, count int64) []read {
		var rs []read
		for i := range count {
			rs = append(rs, read{start + i*step, n})
		}
		return rs
	}
	for _, tc := range []struct {
		name  string
		reads []read
		drops int
	}{
		{"large sequential reads", seq(0, 1<<20, 1<<20, 64), 0},
		{"holes every 16 KiB", seq(4096, 16<<10, 4096, 64), 1},
		{"holes over 256 MiB: once per 64 MiB", seq(4096, 1<<20, 4096, 256), 4},
		{"random small reads", []read{{900 << 20, 4096}, {3 << 20, 4096}, {77 << 20, 4096}, {5 << 20, 4096},
			{400 << 20, 4096}, {2 << 20, 4096}, {600 << 20, 4096}, {1 << 20, 4096}, {9 << 20, 4096}, {0, 4096}}, 0},
		{"seven small, then large", append(seq(0, 4096, 4096, 7), seq(28672, 1<<20, 1<<20, 8)...), 0},
		{"small backwards", seq(64<<20, -8192, 4096, 64), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHoleWatch()
			drops := 0
			for _, r := range tc.reads {
				if h.read(r.off, r.n) {
					drops++
				}
			}
			if drops != tc.drops {
				t.Errorf("%d drops, want %d", drops, tc.drops)
			}
		})
	}
}
