package fat

import (
	"container/list"
	"sync"
)

// lru is a cache bounded by the total cost of its values (bytes, entries:
// whatever the owner counts), dropping the least recently used first. A
// value costlier than the whole budget is not kept. Its lock guards the
// list and the map; the values themselves are immutable once put.
type lru[K comparable, V any] struct {
	mu     sync.Mutex
	budget int
	cost   int
	order  *list.List // front: most recently used
	items  map[K]*list.Element
}

type lruItem[K comparable, V any] struct {
	key  K
	val  V
	cost int
}

func newLRU[K comparable, V any](budget int) *lru[K, V] {
	return &lru[K, V]{budget: budget, order: list.New(), items: map[K]*list.Element{}}
}

func (c *lru[K, V]) get(k K) (V, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.items[k]; ok {
		c.order.MoveToFront(e)
		return e.Value.(*lruItem[K, V]).val, true
	}
	var zero V
	return zero, false
}

func (c *lru[K, V]) put(k K, v V, cost int) {
	if cost > c.budget {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.items[k]; ok {
		it := e.Value.(*lruItem[K, V])
		c.cost += cost - it.cost
		it.val, it.cost = v, cost
		c.order.MoveToFront(e)
	} else {
		c.items[k] = c.order.PushFront(&lruItem[K, V]{k, v, cost})
		c.cost += cost
	}
	for c.cost > c.budget {
		e := c.order.Back()
		it := e.Value.(*lruItem[K, V])
		c.order.Remove(e)
		delete(c.items, it.key)
		c.cost -= it.cost
	}
}
