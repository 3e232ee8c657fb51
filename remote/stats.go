package remote

import "sync/atomic"

// Stats counts what an Object, or all objects of a Client, cost and saved.
// Counters only grow.
type Stats struct {
	Requests   int64 `json:"requests"`   // requests sent, retries included (Open's and List's count for the Client only)
	Bytes      int64 `json:"bytes"`      // body bytes received (Open's for the Client only)
	Retries    int64 `json:"retries"`    // attempts repeated after a transient failure
	Hits       int64 `json:"hits"`       // chunks read found in the memory cache
	Misses     int64 `json:"misses"`     // chunks read not in the memory cache
	DiskHits   int64 `json:"disk-hits"`  // misses read from the disk cache
	Waits      int64 `json:"waits"`      // misses that waited for a fetch already in flight
	Prefetched int64 `json:"prefetched"` // chunks fetched ahead of a sequential reader
	Dropped    int64 `json:"dropped"`    // prefetches given up (no free connection, or failed)
	Direct     int64 `json:"direct"`     // chunks read around the cache (every slot was busy)
	Errors     int64 `json:"errors"`     // ReadAt calls that failed
}

// ClientStats is Stats over all objects of a Client, and its caches.
type ClientStats struct {
	Stats
	Objects      int   `json:"objects"`       // Objects open
	CacheBuffers int   `json:"cache-buffers"` // chunk buffers allocated (each ChunkSize bytes)
	CacheChunks  int   `json:"cache-chunks"`  // chunks held in memory
	DiskBytes    int64 `json:"disk-bytes"`    // bytes of the disk cache's files
	// Hydration is every hydration started (hydrate.go), in order.
	Hydration []HydrationStatus `json:"hydration,omitempty"`
	// Offline: nothing is fetched; what the disk cache lacks fails
	// (Options.Offline).
	Offline bool `json:"offline,omitempty"`
}

// counters are the atomic form of Stats.
type counters struct {
	requests, bytes, retries, hits, misses, diskHits, waits, prefetched, dropped, direct, errors atomic.Int64
}

func (k *counters) load() Stats {
	return Stats{
		Requests: k.requests.Load(), Bytes: k.bytes.Load(), Retries: k.retries.Load(),
		Hits: k.hits.Load(), Misses: k.misses.Load(), DiskHits: k.diskHits.Load(),
		Waits: k.waits.Load(), Prefetched: k.prefetched.Load(), Dropped: k.dropped.Load(),
		Direct: k.direct.Load(), Errors: k.errors.Load(),
	}
}

// count applies f to an object's counters (if st is not nil) and the
// Client's.
func (c *Client) count(st *counters, f func(*counters)) {
	if st != nil {
		f(st)
	}
	f(&c.st)
}
