// Package remote tests images over HTTP(S) and S3 (nginx, versitygw, a
// fault proxy) through a mount and through info, map and check, and
// writable mounts of them through local overlays (overlay_test.go);
// encrypted images read, and written through encrypted overlays
// (encrypted_test.go).
package remote

import (
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
