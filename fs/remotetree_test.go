package fs

import (
	"reflect"
	"testing"
)

// TestKeyPath: keys that make a path are shown; keys with empty, "." or
// ".." segments (which a path cannot hold, or would leave the tree) or
// names too long for a file system are not.
func TestKeyPath(t *testing.T) {
	long := string(make([]byte, 256))
	for _, c := range []struct {
		key  string
		ok   bool
		want string
	}{
		{"vm.qcow2", true, "vm.qcow2"},
		{"a/b/vm.qcow2", true, "a/b/vm.qcow2"},
		{"", false, ""},
		{"a//b", false, ""},
		{"/a", false, ""},
		{"a/", false, ""},
		{"a/./b", false, ""},
		{"a/../b", false, ""},
		{"..", false, ""},
		{"a/" + long, false, ""},
		{"a\x00b", false, ""},
	} {
		got, ok := keyPath(c.key)
		if ok != c.ok || got != c.want {
			t.Errorf("keyPath(%q) = %q, %v; want %q, %v", c.key, got, ok, c.want, c.ok)
		}
	}
}

// TestListingFolders: a listing's folders are made from its keys, a name
// that is both an object and a folder is a folder, and a folder's version
// changes with its children's names, sizes and ETags only.
func TestListingFolders(t *testing.T) {
	make := func(objs map[string]remoteObject) *listing {
		l := &listing{objects: map[string]remoteObject{}, dirs: map[string]*remoteDir{}, byURL: map[string]string{}}
		for rel, o := range objs {
			o.url = "s3://b/p/" + rel
			l.add(rel, o)
		}
		l.finish()
		return l
	}
	l := make(map[string]remoteObject{
		"a.qcow2": {size: 1, etag: "x"}, "d/b.qcow2": {size: 2}, "d/e/c.qcow2": {size: 3}, "d": {size: 4},
	})
	want := map[string][]string{"": {"a.qcow2", "d"}, "d": {"b.qcow2", "e"}, "d/e": {"c.qcow2"}}
	for dir, names := range want {
		if d := l.dirs[dir]; d == nil || !reflect.DeepEqual(d.children, names) {
			t.Errorf("folder %q: %+v, want children %q", dir, d, names)
		}
	}
	if len(l.dirs) != len(want) {
		t.Errorf("%d folders, want %d", len(l.dirs), len(want))
	}
	if _, ok := l.objects["d"]; ok {
		t.Errorf("the object d is shown beside the folder d")
	}
	same := make(map[string]remoteObject{"a.qcow2": {size: 1, etag: "x"}, "d/b.qcow2": {size: 2}, "d/e/c.qcow2": {size: 3}})
	if same.dirs[""].ver != l.dirs[""].ver {
		t.Errorf("the same children give another folder version")
	}
	changed := make(map[string]remoteObject{"a.qcow2": {size: 1, etag: "y"}, "d/b.qcow2": {size: 2}, "d/e/c.qcow2": {size: 3}})
	if changed.dirs[""].ver == l.dirs[""].ver {
		t.Errorf("a child's new ETag does not change the folder's version")
	}
}
