package fs

import (
	"fmt"

	"github.com/qcowfs/qcowfs/internal/remotefile"
	"github.com/qcowfs/qcowfs/qcow2"
	"github.com/qcowfs/qcowfs/remote"
)

// Hydration (Config.Hydrate): the first time a reader opens a remote
// image (its raw file or a partition), the mount fetches everything a
// read of the whole disk needs (qcow2.Image.HostRanges: every layer's
// metadata and the data clusters, never holes) into the remote client's
// disk cache in the background (remote.Object.Hydrate), each remote file
// of the chain once per version, however many images share it. Images
// the mount only lists (the background count of st_blocks, a stat) are
// not hydrated. The image whose ranges are hydrated is one of its own,
// opened beside the registry's, so that it keeps the chain's objects open
// until every hydration of it has ended or the mount closes.

// startHydration starts hydrating the image at rel, unless the mount
// does not hydrate, its source is local, or it already did for this
// generation of the file.
func (m *mount) startHydration(d diskID, rel string) {
	if !m.cfg.Hydrate || m.cfg.Remote == nil {
		return
	}
	m.hydMu.Lock()
	if m.hydrated == nil {
		m.hydrated = map[string]bool{}
	}
	key := fmt.Sprintf("%s\x00%d", rel, d.gen)
	if m.hydrated[key] {
		m.hydMu.Unlock()
		return
	}
	m.hydrated[key] = true
	m.hydMu.Unlock()
	go m.hydrate(rel)
}

func (m *mount) hydrate(rel string) {
	f, _, err := m.src.openImage(rel, false)
	if err != nil {
		m.log.Warn("hydration not started", "image", m.src.abs(rel), "err", err)
		return
	}
	img, err := qcow2.NewImage(f, m.imageOptions())
	if err != nil {
		m.log.Warn("hydration not started", "image", m.src.abs(rel), "err", err)
		return
	}
	defer img.Close()
	// The spans of each remote file, in chain order (top first).
	var order []*remotefile.File
	spans := map[*remotefile.File][]remote.Span{}
	err = img.HostRanges(m.ctx, func(r qcow2.HostRange) error {
		rf, ok := r.File.(*remotefile.File)
		if !ok {
			return nil
		}
		if _, seen := spans[rf]; !seen {
			order = append(order, rf)
		}
		spans[rf] = append(spans[rf], remote.Span{Off: r.Off, Len: r.Len})
		return nil
	})
	if err != nil {
		if m.ctx.Err() == nil {
			m.log.Warn("hydration not started: the image's tables cannot be read", "image", m.src.abs(rel), "err", err)
		}
		return
	}
	var running []*remote.Hydration
	for _, rf := range order {
		key := rf.Object.URL() + "\x00" + rf.Object.Version()
		m.hydMu.Lock()
		seen := m.hydrated[key]
		m.hydrated[key] = true
		m.hydMu.Unlock()
		if seen {
			continue // another image's chain has it
		}
		h, err := rf.Object.Hydrate(spans[rf])
		if err != nil {
			m.log.Warn("hydration not started", "image", m.src.abs(rel), "file", rf.Name(), "err", err)
			continue
		}
		m.log.Info("hydrating", "image", m.src.abs(rel), "file", rf.Name(), "bytes", h.Status().Needed)
		running = append(running, h)
	}
	for _, h := range running {
		select {
		case <-h.Done():
		case <-m.ctx.Done():
			return
		}
	}
}
