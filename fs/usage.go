package fs

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"

	"github.com/qcowfs/qcowfs/qcow2"
)

// Disk usage: st_blocks of an image file.
//
// st_blocks tells `du` and `ls -s` how much an image really holds, and
// tells `cp` whether to look for holes at all (coreutils only tries
// SEEK_DATA when st_blocks*512 < st_size). The exact figure, the bytes
// outside holes, needs every L2 table of the chain, so it is counted in
// the background, one image at a time, after an image is first looked up;
// until then st_blocks is the space the image's files take on the host,
// capped at the virtual size. When the count is done the kernel is told to
// drop the file's cached attributes.
//
// A count is bounded: by the library's work budget for it
// (qcow2.CountWork: tables that repeat are walked once, unallocated
// stretches skipped), and by usageTimeout; one that does not finish leaves
// the estimate in place, with one log line. Counts stop when the mount
// ends.

// maxUsageEntries bounds the usage table; it is cleared when full.
const maxUsageEntries = 1 << 16

// usageTimeout bounds one image's count.
const usageTimeout = 2 * time.Minute

type usageTable struct {
	mu      sync.Mutex
	bytes   map[diskID]int64       // exact data bytes, once counted
	pending map[diskID]usageJob    // queued or being counted
	jobs    map[diskID]usageJob    // every disk asked for, to count again after writes
	nodes   map[diskID]*gofs.Inode // the node to notify, if looked up
	written map[diskID]bool        // whole disks written since last counted
	queue   chan diskID
}

func newUsageTable() *usageTable {
	return &usageTable{
		bytes:   map[diskID]int64{},
		pending: map[diskID]usageJob{},
		jobs:    map[diskID]usageJob{},
		nodes:   map[diskID]*gofs.Inode{},
		written: map[diskID]bool{},
		queue:   make(chan diskID, 1024),
	}
}

// get returns the counted data bytes of v, if known and not outdated by
// writes.
func (u *usageTable) get(v diskID) (int64, bool) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.written[v.base()] {
		return 0, false
	}
	n, ok := u.bytes[v]
	return n, ok
}

// usageJob is what to count: the data of [start, end) of the disk of the
// image at rel.
type usageJob struct {
	rel        string
	start, end int64
}

// request queues a count of disk v, once per version. A full queue drops
// the request; the estimate then stands until a later lookup.
func (u *usageTable) request(v diskID, job usageJob) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if len(u.jobs) >= maxUsageEntries {
		clear(u.jobs)
	}
	u.jobs[v] = job
	if _, ok := u.bytes[v]; ok {
		return
	}
	if _, ok := u.pending[v]; ok {
		return
	}
	select {
	case u.queue <- v:
		u.pending[v] = job
	default:
	}
}

// forget marks disk d (and its partitions) written: its count no longer
// holds, and an estimate stands until recount. Only the first write after
// a count does anything.
func (u *usageTable) forget(d diskID) {
	b := d.base()
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.written[b] {
		return
	}
	u.written[b] = true
	for k, n := range u.nodes {
		if k.base() == b {
			go n.NotifyContent(-1, 0) // attributes only
		}
	}
}

// recount counts disk d and its partitions again, after writes.
func (u *usageTable) recount(d diskID) {
	b := d.base()
	u.mu.Lock()
	delete(u.written, b)
	var again []diskID
	for k := range u.jobs {
		if k.base() == b {
			delete(u.bytes, k)
			again = append(again, k)
		}
	}
	jobs := make([]usageJob, len(again))
	for i, k := range again {
		jobs[i] = u.jobs[k]
	}
	u.mu.Unlock()
	for i, k := range again {
		u.request(k, jobs[i])
	}
}

// watch remembers the node of v, to notify the kernel when v is counted.
func (u *usageTable) watch(v diskID, n *gofs.Inode) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if len(u.nodes) >= maxUsageEntries {
		clear(u.nodes)
	}
	u.nodes[v] = n
}

// countUsage counts queued images until ctx is done.
func (m *mount) countUsage(ctx context.Context) {
	u := m.usage
	for {
		var v diskID
		select {
		case <-ctx.Done():
			return
		case v = <-u.queue:
		}
		u.mu.Lock()
		job := u.pending[v]
		u.mu.Unlock()

		n, err := m.dataBytes(ctx, v, job)
		u.mu.Lock()
		delete(u.pending, v)
		if err == nil {
			if len(u.bytes) >= maxUsageEntries {
				clear(u.bytes)
			}
			u.bytes[v] = n
		}
		node := u.nodes[v]
		u.mu.Unlock()
		if err != nil {
			if errors.Is(err, qcow2.ErrWalkBudget) || errors.Is(err, context.DeadlineExceeded) {
				m.log.Warn("the data of an image was not counted: its tables need more than a bounded walk; st_blocks stays an estimate",
					"image", m.src.abs(job.rel), "err", err)
			} else {
				m.log.Debug("cannot count the data of an image", "image", m.src.abs(job.rel), "err", err)
			}
			continue
		}
		if node != nil {
			// Attributes only (offset -1): the content is unchanged.
			node.NotifyContent(-1, 0)
		}
	}
}

// dataBytes counts the data of a disk, sharing the open image (and so its
// block status index) with readers. A panic of the library fails this
// count only.
func (m *mount) dataBytes(ctx context.Context, d diskID, job usageJob) (n int64, err error) {
	defer func() {
		if r := recover(); r != nil {
			m.log.Error("internal error (panic) counting the data of an image; only this image is affected",
				"image", m.src.abs(job.rel), "panic", fmt.Sprint(r), "stack", string(debug.Stack()))
			n, err = 0, fmt.Errorf("internal error: %v", r)
		}
	}()
	oi, err := m.acquire(d, job.rel)
	if err != nil {
		return 0, err
	}
	defer m.release(oi)
	ctx, cancel := context.WithTimeout(ctx, usageTimeout)
	defer cancel()
	return oi.image().DataBytesIn(ctx, job.start, job.end)
}
