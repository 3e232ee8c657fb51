package fuseuring

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// A Server serves requests: go-fuse's *fuse.Server (third_party/go-fuse's
// patch adds both methods).
type Server interface {
	// HandleRequest serves one request in the /dev/fuse layout and
	// writes the reply, returning its length.
	HandleRequest(in, out [][]byte) (int, fuse.Status)
	// DeviceFd runs f with the mount's /dev/fuse descriptor.
	DeviceFd(f func(fd int)) error
}

// Param is the kernel's switch for FUSE over io_uring.
const Param = "/sys/module/fuse/parameters/enable_uring"

// ErrUnavailable is what Check and Start return when the kernel will not
// serve the mount over a ring; the error says why.
var ErrUnavailable = errors.New("FUSE over io_uring unavailable")

// Check says whether the kernel offers FUSE over io_uring to new mounts:
// built in (the parameter exists) and switched on.
func Check() error {
	b, err := os.ReadFile(Param)
	if err != nil {
		return fmt.Errorf("%w: the kernel has no %s (FUSE over io_uring needs Linux 6.14 or later built with CONFIG_FUSE_IO_URING)", ErrUnavailable, Param)
	}
	if v := strings.TrimSpace(string(b)); v != "Y" {
		return fmt.Errorf("%w: %s is %s (as root: echo Y > %s)", ErrUnavailable, Param, v, Param)
	}
	return nil
}

// maxLanes bounds the lanes of a queue: the requests of one CPU's
// callers served at once (go-fuse's classic loop has at most 16 readers
// waiting, and serves any number of requests).
const maxLanes = 16

// A Transport serves a mount's requests over one io_uring queue per
// CPU, each of one or more lanes (lane.go). INIT, FORGET, INTERRUPT and
// notifications stay on /dev/fuse, with go-fuse's loop.
type Transport struct {
	server      Server
	payloadSize int
	logf        func(format string, args ...any)
	queues      []*queue
	lanes       sync.WaitGroup
	requests    atomic.Uint64
}

// A queue is the kernel's queue of one CPU, and its lanes.
type queue struct {
	t     *Transport
	qid   int
	mu    sync.Mutex // guards n and the start of a lane
	n     int
	idle  atomic.Int32 // lanes whose entry waits in the kernel for a request
	first *lane        // made by New, started by Start
}

// New sets up the rings before the mount is made, one queue for each CPU
// the kernel may have (it makes one queue per possible CPU and serves
// none until every one has an entry), each with buffers of maxWrite
// bytes, the mount's largest request or reply. A mount that asks for the
// ring at INIT must then register it or hang, so whatever the kernel may
// refuse at setup is tried here, where the mount can still go without.
func New(maxWrite int, logf func(string, ...any)) (*Transport, error) {
	if err := Check(); err != nil {
		return nil, err
	}
	n, err := possibleCPUs()
	if err != nil {
		return nil, err
	}
	page := os.Getpagesize()
	t := &Transport{payloadSize: (max(minPayload, maxWrite) + page - 1) / page * page, logf: logf}
	for qid := range n {
		q := &queue{t: t, qid: qid, n: 1}
		if q.first, err = newLane(q); err != nil {
			t.closeUnstarted()
			return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
		}
		t.queues = append(t.queues, q)
	}
	return t, nil
}

func (t *Transport) closeUnstarted() {
	for _, q := range t.queues {
		if q.first != nil {
			q.first.close()
			q.first = nil
		}
	}
}

// Start registers the rings with the mount's connection, whose INIT
// accepted FUSE_OVER_IO_URING, and serves requests until the connection
// ends. A refused registration makes the kernel go back to /dev/fuse for
// the mount, and Start returns why.
func (t *Transport) Start(server Server) error {
	t.server = server
	for _, q := range t.queues {
		if err := q.first.attach(); err != nil {
			t.closeUnstarted()
			return fmt.Errorf("%w: %v", ErrUnavailable, err)
		}
	}
	errs := make(chan error, len(t.queues))
	for _, q := range t.queues {
		l := q.first
		q.first = nil
		t.lanes.Add(1)
		go func() {
			defer t.lanes.Done()
			l.serve(func(err error) { errs <- err })
		}()
	}
	var first error
	for range t.queues {
		if err := <-errs; err != nil && first == nil {
			first = fmt.Errorf("%w: %v", ErrUnavailable, err)
		}
	}
	return first
}

// attach gives the lane's ring the mount's /dev/fuse.
func (l *lane) attach() error {
	var err error
	if ferr := l.q.t.server.DeviceFd(func(fd int) { err = l.ring.registerFile(fd) }); ferr != nil {
		return fmt.Errorf("/dev/fuse: %w", ferr)
	}
	return err
}

// taken is a lane's entry getting a request: if it was the queue's last
// idle one, another lane is started, so that a handler that blocks does
// not hold back the CPU's next request.
func (q *queue) taken() {
	q.t.requests.Add(1)
	if q.idle.Add(-1) > 0 {
		return
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.n >= maxLanes {
		return
	}
	l, err := newLane(q)
	if err == nil {
		err = l.attach()
		if err != nil {
			l.close()
		}
	}
	if err != nil {
		q.t.logf("queue %d: another ring entry: %v", q.qid, err)
		return
	}
	q.n++
	q.t.lanes.Add(1)
	go func() {
		defer q.t.lanes.Done()
		l.serve(func(err error) {
			if err != nil {
				q.t.logf("queue %d: another ring entry: %v", q.qid, err)
			}
		})
	}()
}

// Wait returns once every lane has ended (the connection is gone) and
// its handler returned.
func (t *Transport) Wait() { t.lanes.Wait() }

// Requests is how many requests came over the rings.
func (t *Transport) Requests() uint64 { return t.requests.Load() }

// possibleCPUs is how many CPUs the kernel may bring up: the kernel's
// num_possible_cpus(), the count of the ring's queues.
func possibleCPUs() (int, error) {
	b, err := os.ReadFile("/sys/devices/system/cpu/possible")
	if err != nil {
		return 0, err
	}
	n := 0
	for _, r := range strings.Split(strings.TrimSpace(string(b)), ",") {
		var lo, hi int
		if k, _ := fmt.Sscanf(r, "%d-%d", &lo, &hi); k == 2 {
			n = max(n, hi+1)
		} else if k == 1 {
			n = max(n, lo+1)
		} else {
			return 0, fmt.Errorf("/sys/devices/system/cpu/possible: %q", b)
		}
	}
	return n, nil
}

// Close releases rings that were set up and not started.
func (t *Transport) Close() { t.closeUnstarted() }
