package read

import (
	"testing"

	"github.com/qcowfs/qcowfs/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
