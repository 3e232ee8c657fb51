package main

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/alecthomas/kong"
)

// byteSize is a size flag: a number of bytes with an optional binary
// suffix, K, M, G or T (KiB, MiB, ... and lower case are accepted too).
type byteSize int64

func (b *byteSize) UnmarshalText(text []byte) error {
	s := strings.TrimSpace(string(text))
	num := strings.TrimRight(s, "KMGTkmgtiIbB")
	unit := strings.ToUpper(strings.TrimSuffix(strings.TrimSuffix(s[len(num):], "B"), "b"))
	unit = strings.TrimSuffix(unit, "I")
	shift := map[string]uint{"": 0, "K": 10, "M": 20, "G": 30, "T": 40}
	sh, ok := shift[unit]
	n, err := strconv.ParseInt(num, 10, 64)
	if !ok || err != nil || n < 0 || n > (1<<62)>>sh {
		return fmt.Errorf("bad size %q: want a number with an optional K, M, G or T suffix", s)
	}
	*b = byteSize(n << sh)
	return nil
}

// hydrateFlag is --hydrate[=RATE]: on, with an optional cap in bytes a
// second (a size, 50M). Bare, it takes no value, as a bool flag does
// (kong.BoolMapper): --hydrate is on without a cap.
type hydrateFlag struct {
	On   bool
	Rate byteSize
}

func (h *hydrateFlag) Decode(ctx *kong.DecodeContext) error {
	h.On = true
	if ctx.Scan.Peek().Type != kong.FlagValueToken {
		return nil
	}
	v := fmt.Sprint(ctx.Scan.Pop().Value)
	if err := h.Rate.UnmarshalText([]byte(v)); err != nil || h.Rate == 0 {
		return fmt.Errorf("--hydrate=%s: want a rate in bytes a second, a number with an optional K, M or G suffix (50M)", v)
	}
	return nil
}

// IsBool lets --hydrate go without a value.
func (h *hydrateFlag) IsBool() bool { return true }
