package fs

import (
	"bytes"
	"fmt"
	"strconv"
	"strings"

	"github.com/qcowfs/qcowfs/internal/remotefile"
	"github.com/qcowfs/qcowfs/qcow2"
)

// The base of an overlay over a remote image must not change under it: a
// remote object can be replaced by anyone at any time, and an overlay's
// clusters only make sense over the very bytes they were written on. So
// an overlay of a remote image records, when it is made, the size and
// version (remote.Object.Version: the S3 version id, else the ETag, else
// the Last-Modified time) of every remote file of its backing chain, top
// first, in a header extension of its own (baseExtension), which qemu
// keeps as it is when it rewrites the header (qcow2.TestCreateExtensionKept)
// and otherwise ignores. Every later open of the overlay compares the
// record with the chain it opened: an overlay whose base is now another
// version, or that records none, is not served (BaseChangedError), unless
// Config.AcceptChangedBase. The record is never rewritten: an overlay
// served over another base keeps saying what it was made on.
//
// Overlays of local images need no record: the original is the file at a
// path, checked by device and inode when the overlay opens it
// (overlayOpener).

// baseExtension is the header extension type of the record ("qcfs").
const baseExtension = 0x71636673

// baseMagic is the record's first line.
const baseMagic = "qcowfs overlay base 1"

// A baseLayer is one remote file of an overlay's backing chain.
type baseLayer struct {
	url     string // redacted, for messages (not recorded: the chain names it)
	size    int64
	version string
}

// baseOf returns the remote files among files (a backing chain, top
// first), in order.
func baseOf(files []qcow2.HostFile) []baseLayer {
	var out []baseLayer
	for _, f := range files {
		if rf, ok := f.(*remotefile.File); ok {
			out = append(out, baseLayer{url: rf.Name(), size: rf.Object.Size(), version: rf.Object.Version()})
		}
	}
	return out
}

// encodeBase is the record of layers: the magic line, then one line per
// layer, "SIZE \"VERSION\"".
func encodeBase(layers []baseLayer) []byte {
	var b bytes.Buffer
	b.WriteString(baseMagic + "\n")
	for _, l := range layers {
		fmt.Fprintf(&b, "%d %s\n", l.size, strconv.Quote(l.version))
	}
	return b.Bytes()
}

// decodeBase parses a record made by encodeBase.
func decodeBase(data []byte) ([]baseLayer, error) {
	lines := strings.Split(strings.TrimSuffix(string(data), "\n"), "\n")
	if lines[0] != baseMagic {
		return nil, fmt.Errorf("the record of its base begins %q, not %q", lines[0], baseMagic)
	}
	var out []baseLayer
	for _, line := range lines[1:] {
		size, ver, ok := strings.Cut(line, " ")
		n, err := strconv.ParseInt(size, 10, 64)
		if !ok || err != nil {
			return nil, fmt.Errorf("bad line %q in the record of its base", line)
		}
		v, err := strconv.Unquote(ver)
		if err != nil {
			return nil, fmt.Errorf("bad version in line %q of the record of its base", line)
		}
		out = append(out, baseLayer{size: n, version: v})
	}
	return out, nil
}

// A BaseChangedError refuses an overlay whose remote base is not what it
// was made on: a layer of its backing chain has another version (or
// size), the chain has more or fewer remote files, or the overlay records
// nothing (made by another program, or damaged). Mounting with
// --accept-changed-base (Config.AcceptChangedBase) serves it anyway.
type BaseChangedError struct {
	Image   string // the image, as messages name it
	Overlay string // the overlay's path
	Base    string // the URL (redacted) of the first layer that differs
	// The versions recorded and found, "" where the chain had or has
	// no such layer, and their sizes.
	Was, Now         string
	WasSize, NowSize int64
	Reason           string // why there is no record, if there is none
}

func (e *BaseChangedError) Error() string {
	ver := func(v string, size, other int64) string {
		s := "version " + showVersion(v)
		if size != other {
			s += fmt.Sprintf(" (%d bytes)", size)
		}
		return s
	}
	const why = "not served, so that its writes never land on another base"
	switch {
	case e.Reason != "":
		return fmt.Sprintf("%s: its overlay %s does not say which version of %s it was made on (%s; it is now %s); %s",
			e.Image, e.Overlay, e.Base, e.Reason, ver(e.Now, 0, 0), why)
	case e.Now == "":
		return fmt.Sprintf("%s: its overlay %s was made on a backing chain with one more remote file (%s), which the chain has no longer; %s",
			e.Image, e.Overlay, ver(e.Was, 0, 0), why)
	case e.Was == "":
		return fmt.Sprintf("%s: its overlay %s was made on a backing chain without %s (now %s); %s",
			e.Image, e.Overlay, e.Base, ver(e.Now, 0, 0), why)
	}
	return fmt.Sprintf("%s: its overlay %s was made on %s of %s, which is now %s; %s",
		e.Image, e.Overlay, ver(e.Was, e.WasSize, e.NowSize), e.Base, ver(e.Now, e.NowSize, e.WasSize), why)
}

// baseRecord is the extension an overlay of oi records: none for a local
// original.
func baseRecord(oi *openImage) []qcow2.Extension {
	layers := baseOf(append([]qcow2.HostFile{oi.orig.File()}, oi.orig.Chain()...))
	if len(layers) == 0 {
		return nil
	}
	return []qcow2.Extension{{Type: baseExtension, Data: encodeBase(layers)}}
}

// checkBase compares the record of the overlay img of oi with the backing
// chain img opened: nil if they agree (or the chain is local), else a
// BaseChangedError, which Config.AcceptChangedBase turns into a log line.
func (m *mount) checkBase(oi *openImage, img *qcow2.Image) error {
	now := baseOf(img.Chain())
	if len(now) == 0 {
		return nil
	}
	e := &BaseChangedError{Image: oi.path, Overlay: oi.overlay, Base: now[0].url}
	data, ok := img.Header().Extension(baseExtension)
	var was []baseLayer
	if !ok {
		e.Reason = "it has no record of its base"
	} else if layers, err := decodeBase(data); err != nil {
		e.Reason = err.Error()
	} else {
		was = layers
	}
	if e.Reason == "" {
		i := 0
		for i < len(was) && i < len(now) && was[i].size == now[i].size && was[i].version == now[i].version {
			i++
		}
		if i == len(was) && i == len(now) {
			return nil
		}
		if i < len(was) {
			e.Was, e.WasSize = was[i].version, was[i].size
		}
		e.Base = ""
		if i < len(now) {
			e.Base, e.Now, e.NowSize = now[i].url, now[i].version, now[i].size
		}
	} else {
		e.Now = now[0].version
	}
	if m.cfg.AcceptChangedBase {
		m.log.Warn("overlay served over a base it was not made on (--accept-changed-base)", "image", oi.path, "overlay", oi.overlay, "reason", e.Error())
		return nil
	}
	return e
}

// showVersion quotes a version for messages, unless it is an ETag, which
// carries its own quotes.
func showVersion(v string) string {
	if len(v) >= 2 && strings.HasSuffix(v, `"`) && (strings.HasPrefix(v, `"`) || strings.HasPrefix(v, `W/"`)) && !strings.ContainsAny(v, "\n") {
		return v
	}
	return strconv.Quote(v)
}
