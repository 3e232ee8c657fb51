package main

import (
	"fmt"
	"runtime"
	"runtime/debug"

	"github.com/qcowfs/qcowfs/qcow2"
)

type versionCmd struct{}

// versionLine is what --version prints.
func versionLine() string { return "qcowfs " + version }

func (versionCmd) Help() string {
	return `Examples:

  qcowfs version
  qcowfs --version        the first line only`
}

// Run prints the version and what the binary was built with, one fact a
// line.
func (versionCmd) Run() error {
	fmt.Println(versionLine())
	fmt.Println("go:", runtime.Version())
	fuseVersion := "unknown"
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, d := range bi.Deps {
			if d.Path == "github.com/hanwen/go-fuse/v2" {
				fuseVersion = d.Version
				if r := d.Replace; r != nil {
					// A folder (third_party/go-fuse, patched) has
					// no version of its own.
					fuseVersion += " => " + r.Path
					if r.Version != "" && r.Version != "(devel)" {
						fuseVersion += " " + r.Version
					}
				}
			}
		}
	}
	fmt.Println("go-fuse:", fuseVersion)
	inflate := "compress/flate (built without cgo)"
	if qcow2.Libdeflate() {
		inflate = "libdeflate"
	}
	fmt.Println("deflate:", inflate)
	return nil
}

type helpCmd struct {
	Command []string `arg:"" optional:"" help:"The command."`
}

func (helpCmd) Help() string {
	return `Examples:

  qcowfs help
  qcowfs help mount       the same as qcowfs mount --help
  man qcowfs              everything, once make install has put the page in place`
}

// Run is never reached: prepareArgs turns "help CMD" into "CMD --help".
func (helpCmd) Run() error { return nil }
