package main

import (
	"fmt"
	"log/slog"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/qcowfs/qcowfs/fs"
	"github.com/qcowfs/qcowfs/internal/fuseuring"
)

// A ringChoice is what --io-uring made of the kernel's offer: the rings
// to start after INIT (nil: /dev/fuse alone).
type ringChoice struct {
	mode    string // auto, on
	t       *fuseuring.Transport
	serving bool  // the rings started
	why     error // why not, with auto
	log     *slog.Logger
}

// newRing sets up the rings before the mount for --io-uring=auto or on,
// and asks for them at INIT. on fails when the kernel does not offer the
// ring; auto says so in one log line and mounts on /dev/fuse.
func (c *mountCmd) newRing(opts *gofs.Options, log *slog.Logger) (*ringChoice, error) {
	rc := &ringChoice{mode: c.IOUring, log: log}
	if c.IOUring == "off" {
		return rc, nil
	}
	logf := func(format string, args ...any) { log.Warn("io_uring: " + fmt.Sprintf(format, args...)) }
	t, err := fuseuring.New(opts.MaxWrite, logf)
	if err != nil {
		return rc, rc.without(err)
	}
	rc.t = t
	opts.ExtraCapabilities |= fuse.CAP_OVER_IO_URING
	return rc, nil
}

// without is the ring not to be had: the mount's error with on, a log
// line with auto (report).
func (rc *ringChoice) without(err error) error {
	if rc.mode == "on" {
		return fmt.Errorf("--io-uring=on: %w", err)
	}
	rc.why = err
	return nil
}

// report logs the transport the mount serves over, once it is made (not
// while mountFUSE holds stderr for fusermount3's words).
func (rc *ringChoice) report() {
	switch {
	case rc.serving:
		rc.log.Info("serving over io_uring")
	case rc.why != nil:
		rc.log.Info("serving over /dev/fuse", "io_uring", rc.why.Error())
	}
}

// afterInit starts the rings once INIT has accepted them.
func (rc *ringChoice) afterInit(root *fs.Root) func(*fuse.Server) error {
	return func(server *fuse.Server) error {
		if rc.t == nil {
			return nil
		}
		if server.KernelSettings().Flags64()&fuse.CAP_OVER_IO_URING == 0 {
			rc.t.Close()
			return rc.without(fmt.Errorf("%w: the kernel's INIT did not offer it", fuseuring.ErrUnavailable))
		}
		root.CopyReads()
		if err := rc.t.Start(server); err != nil {
			return rc.without(err)
		}
		rc.serving = true
		return nil
	}
}

// wait returns once the rings' lanes have ended, with the requests they
// were serving.
func (rc *ringChoice) wait() {
	if rc != nil && rc.t != nil {
		rc.t.Wait()
	}
}

// name is the transport the mount serves over, for qcowfs status.
func (rc *ringChoice) name() string {
	if rc != nil && rc.serving {
		return "io_uring"
	}
	return "/dev/fuse"
}
