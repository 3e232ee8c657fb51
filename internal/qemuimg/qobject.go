package qemuimg

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"unicode/utf8"
)

// qemu-img prints its JSON (info, check) from a QDict, a hash table, so
// its keys come in the table's order, not the QAPI schema's; and the
// human "Format specific information" of info is the same QDict dumped
// key by key. To make a textual diff against qemu-img empty, values are
// turned into the same tree here and printed the way qobject/qjson.c
// (to_json, pretty) and block/qapi.c (dump_qobject) print it.

// A qobject is a JSON value with its object keys in insertion order (the
// QAPI order, which is the order of the Go struct's fields).
type qobject struct {
	kind  byte // 'd' dict, 'l' list, 's' string, 'n' number, 'b' bool, 'z' null
	keys  []string
	vals  []*qobject
	items []*qobject
	str   string // a string, or a number as written
	b     bool
}

// toQobject turns v (what encoding/json would print) into a qobject.
func toQobject(v any) (*qobject, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	return decodeQobject(dec)
}

func decodeQobject(dec *json.Decoder) (*qobject, error) {
	tok, err := dec.Token()
	if err != nil {
		return nil, err
	}
	switch t := tok.(type) {
	case json.Delim:
		if t == '{' {
			o := &qobject{kind: 'd'}
			for dec.More() {
				k, err := dec.Token()
				if err != nil {
					return nil, err
				}
				v, err := decodeQobject(dec)
				if err != nil {
					return nil, err
				}
				o.keys = append(o.keys, k.(string))
				o.vals = append(o.vals, v)
			}
			_, err := dec.Token()
			return o, err
		}
		o := &qobject{kind: 'l'}
		for dec.More() {
			v, err := decodeQobject(dec)
			if err != nil {
				return nil, err
			}
			o.items = append(o.items, v)
		}
		_, err := dec.Token()
		return o, err
	case string:
		return &qobject{kind: 's', str: t}, nil
	case json.Number:
		return &qobject{kind: 'n', str: t.String()}, nil
	case bool:
		return &qobject{kind: 'b', b: t}, nil
	default:
		return &qobject{kind: 'z'}, nil
	}
}

// qdictBucket is the bucket of key in qemu's QDict: tdb_hash (from
// Samba's tdb, qobject/qdict.c) modulo QDICT_BUCKET_MAX.
func qdictBucket(key string) uint32 {
	v := uint32(0x238F13AF) * uint32(len(key))
	for i := 0; i < len(key); i++ {
		v += uint32(key[i]) << (uint(i) * 5 % 24)
	}
	return (1103515243*v + 12345) % 512
}

// order returns a dict's entries in QDict iteration order: bucket by
// bucket, and in a bucket the last inserted first (QLIST_INSERT_HEAD).
func (o *qobject) order() []int {
	idx := make([]int, len(o.keys))
	for i := range idx {
		idx[i] = i
	}
	// Insertion sort keeps it stable and obvious; dicts are small.
	for i := 1; i < len(idx); i++ {
		for j := i; j > 0; j-- {
			a, b := idx[j-1], idx[j]
			ba, bb := qdictBucket(o.keys[a]), qdictBucket(o.keys[b])
			if ba > bb || ba == bb && a < b {
				idx[j-1], idx[j] = b, a
				continue
			}
			break
		}
	}
	return idx
}

// writeJSON prints o as qobject_to_json_pretty does.
func (o *qobject) writeJSON(w *bytes.Buffer, indent int) {
	newline := func(n int) {
		w.WriteByte('\n')
		w.WriteString(strings.Repeat("    ", n))
	}
	switch o.kind {
	case 'd':
		w.WriteByte('{')
		for n, i := range o.order() {
			if n > 0 {
				w.WriteByte(',')
			}
			newline(indent + 1)
			writeQString(w, o.keys[i])
			w.WriteString(": ")
			o.vals[i].writeJSON(w, indent+1)
		}
		newline(indent)
		w.WriteByte('}')
	case 'l':
		w.WriteByte('[')
		for n, v := range o.items {
			if n > 0 {
				w.WriteByte(',')
			}
			newline(indent + 1)
			v.writeJSON(w, indent+1)
		}
		newline(indent)
		w.WriteByte(']')
	case 's':
		writeQString(w, o.str)
	case 'n':
		w.WriteString(o.str)
	case 'b':
		fmt.Fprint(w, o.b)
	default:
		w.WriteString("null")
	}
}

// writeQString quotes s as qemu does: the usual escapes, and every code
// point outside printable ASCII as \uXXXX (invalid UTF-8 as U+FFFD).
func writeQString(w *bytes.Buffer, s string) {
	w.WriteByte('"')
	for len(s) > 0 {
		r, size := utf8.DecodeRuneInString(s)
		s = s[size:]
		switch r {
		case '"':
			w.WriteString(`\"`)
		case '\\':
			w.WriteString(`\\`)
		case '\b':
			w.WriteString(`\b`)
		case '\f':
			w.WriteString(`\f`)
		case '\n':
			w.WriteString(`\n`)
		case '\r':
			w.WriteString(`\r`)
		case '\t':
			w.WriteString(`\t`)
		default:
			switch {
			case r > 0xFFFF:
				r -= 0x10000
				fmt.Fprintf(w, `\u%04X\u%04X`, 0xD800+(r>>10), 0xDC00+(r&0x3FF))
			case r < 0x20 || r >= 0x7F:
				fmt.Fprintf(w, `\u%04X`, r)
			default:
				w.WriteRune(r)
			}
		}
	}
	w.WriteByte('"')
}

// dump prints o as block/qapi.c's dump_qobject does for the human
// "Format specific information": one "key: value" line per entry, dashes
// in keys written as spaces, lists as "[i]:".
func (o *qobject) dump(w io.Writer, indent int) {
	pad := strings.Repeat("    ", indent)
	entry := func(label string, v *qobject) {
		if v.kind == 'd' || v.kind == 'l' {
			fmt.Fprintf(w, "%s%s:\n", pad, label)
			v.dump(w, indent+1)
			return
		}
		fmt.Fprintf(w, "%s%s: ", pad, label)
		v.dump(w, indent+1)
		fmt.Fprintln(w)
	}
	switch o.kind {
	case 'd':
		for _, i := range o.order() {
			entry(strings.ReplaceAll(o.keys[i], "-", " "), o.vals[i])
		}
	case 'l':
		for i, v := range o.items {
			entry(fmt.Sprintf("[%d]", i), v)
		}
	case 's', 'n':
		fmt.Fprint(w, o.str)
	case 'b':
		fmt.Fprint(w, o.b)
	}
}

// WriteJSON prints v (what encoding/json would print: a qcow2.Info, a
// RawInfo, a list of them, a qcow2.CheckResult) as qemu-img prints its
// JSON.
func WriteJSON(w io.Writer, v any) error {
	o, err := toQobject(v)
	if err != nil {
		return err
	}
	var b bytes.Buffer
	o.writeJSON(&b, 0)
	b.WriteByte('\n')
	_, err = w.Write(b.Bytes())
	return err
}
