package qcow2

import (
	"errors"
	"sync"
	"sync/atomic"
	"testing"
)

// TestCacheLoadsOnce: concurrent misses on one table load it once.
func TestCacheLoadsOnce(t *testing.T) {
	c := NewCache(1<<20, 0)
	var loads atomic.Int32
	release := make(chan struct{})
	var wg sync.WaitGroup
	for i := 0; i < 32; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tab, err := c.get(cacheKey{owner: 1, off: 4096}, func() ([]uint64, error) {
				loads.Add(1)
				<-release
				return []uint64{42}, nil
			})
			if err != nil || tab.word(0) != 42 {
				t.Errorf("get = %v, %v", tab, err)
			}
		}()
	}
	close(release)
	wg.Wait()
	if n := loads.Load(); n != 1 {
		t.Fatalf("%d loads for one table", n)
	}
}

// TestCacheBounded: the cache never holds more than its budget, and a
// table used again and again survives a scan of others (CLOCK).
func TestCacheBounded(t *testing.T) {
	const tableWords = 1024                      // 8 KiB tables
	c := NewCache(cacheShards*4*tableWords*8, 0) // 4 tables per shard
	load := func() ([]uint64, error) { return make([]uint64, tableWords), nil }
	hot := cacheKey{owner: 2, off: 0}
	for i := 0; i < 10000; i++ {
		c.get(cacheKey{owner: 1, off: int64(i) * 8192}, load)
		c.get(hot, load)
		for s := range c.tables.shards {
			if r := &c.tables.shards[s].ring; r.used > r.capacity {
				t.Fatalf("shard %d holds %d bytes, capacity %d", s, r.used, r.capacity)
			}
		}
	}
	total := 0
	c.tables.m.Range(func(any, any) bool { total++; return true })
	if total > cacheShards*4 {
		t.Fatalf("%d tables cached, budget is %d", total, cacheShards*4)
	}
	if _, ok := c.tables.m.Load(hot); !ok {
		t.Fatal("the table used between every other access was evicted")
	}
	if h := c.tables.shard(hot).hits.Load(); h < 9999 {
		t.Fatalf("the hot table hit %d times of 10000", h)
	}
}

// TestCacheErrorsNotCached: a failed load is retried by the next get.
func TestCacheErrorsNotCached(t *testing.T) {
	c := NewCache(1<<20, 0)
	k := cacheKey{owner: 7, off: 0}
	if _, err := c.get(k, func() ([]uint64, error) { return nil, errors.New("boom") }); err == nil {
		t.Fatal("want the load's error")
	}
	tab, err := c.get(k, func() ([]uint64, error) { return []uint64{1}, nil })
	if err != nil || len(tab.words) != 1 {
		t.Fatalf("retry: %v, %v", tab, err)
	}
}

// TestCacheDrop removes one owner's tables only.
func TestCacheDrop(t *testing.T) {
	c := NewCache(1<<20, 0)
	load := func() ([]uint64, error) { return []uint64{0}, nil }
	for i := 0; i < 100; i++ {
		c.get(cacheKey{owner: 1, off: int64(i)}, load)
		c.get(cacheKey{owner: 2, off: int64(i)}, load)
	}
	c.drop(1)
	c.tables.m.Range(func(k, _ any) bool {
		if k.(cacheKey).owner == 1 {
			t.Fatalf("owner 1's table %v survived drop", k)
		}
		return true
	})
	_, misses := c.Stats()
	c.get(cacheKey{owner: 2, off: 5}, load)
	if _, m := c.Stats(); m != misses {
		t.Fatal("owner 2's table was dropped too")
	}
}

// BenchmarkCacheHit measures parallel hits on 64 tables that fit.
func BenchmarkCacheHit(b *testing.B) {
	c := NewCache(64<<20, 0)
	load := func() ([]uint64, error) { return make([]uint64, 8192), nil }
	for i := 0; i < 64; i++ {
		c.get(cacheKey{owner: 1, off: int64(i)}, load)
	}
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			c.get(cacheKey{owner: 1, off: int64(i & 63)}, load)
			i++
		}
	})
}
