package qcow2

import "sync/atomic"

// The memory budget: every structure whose size an image file decides (L1
// tables, the snapshot table, the refcount table, the metadata map, and
// what is read to build it: snapshot L1 tables, the bitmap directory and
// bitmap tables) is charged to a Budget before it is allocated, and given
// back when the image closes (or, for what is read only to build
// something, as soon as that is built). The specification's limits bound
// each structure; the budget bounds their sum over every open image of a
// mount, like the table cache bounds the tables. An image that would go
// over it is refused (ErrBudget), never allowed to grow the process.

// DefaultBudget is the budget of images opened without one.
const DefaultBudget = 512 << 20

// A Budget is a number of bytes that images may hold in structures read
// from their files. It is safe for concurrent use; share one between the
// images of a mount.
type Budget struct {
	limit int64
	used  atomic.Int64
}

// NewBudget returns a budget of limit bytes.
func NewBudget(limit int64) *Budget { return &Budget{limit: limit} }

// Used returns the bytes charged now.
func (b *Budget) Used() int64 { return b.used.Load() }

// Limit returns the budget's size in bytes.
func (b *Budget) Limit() int64 { return b.limit }

func (b *Budget) take(n int64) bool {
	for {
		u := b.used.Load()
		if n > b.limit-u {
			return false
		}
		if b.used.CompareAndSwap(u, u+n) {
			return true
		}
	}
}

// charge is one image file's account (a nil *charge charges nothing) with a budget: what it holds, given
// back all at once when the file's layer closes.
type charge struct {
	b    *Budget
	file string
	held atomic.Int64
}

func newCharge(b *Budget, file string) *charge { return &charge{b: b, file: file} }

// add charges n more bytes for what (named in the error), or fails with a
// *BudgetError.
func (c *charge) add(n int64, what string) error {
	if c == nil || n <= 0 {
		return nil
	}
	if !c.b.take(n) {
		return &BudgetError{File: c.file, What: what, Need: n, Held: c.held.Load(), Limit: c.b.limit}
	}
	c.held.Add(n)
	return nil
}

// sub gives back n bytes.
func (c *charge) sub(n int64) {
	if c != nil && n > 0 {
		c.held.Add(-n)
		c.b.used.Add(-n)
	}
}

// close gives back everything.
func (c *charge) close() {
	if c != nil {
		c.sub(c.held.Swap(0))
	}
}
