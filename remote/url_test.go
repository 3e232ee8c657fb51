package remote

import (
	"errors"
	"strings"
	"testing"
)

func TestIsURL(t *testing.T) {
	for _, c := range []struct {
		s    string
		want bool
	}{
		{"http://h/x.qcow2", true},
		{"HTTPS://h:8443/a/b", true},
		{"s3://bucket/key", true},
		{"s3://bucket/", true},
		{"s3:///key", false}, // no bucket
		{"file:///etc/passwd", false},
		{"nbd://h/x", false},
		{"json:{}", false},
		{"/local/path.qcow2", false},
		{"relative.qcow2", false},
		{"http:relative", false},
		{"", false},
	} {
		if got := IsURL(c.s); got != c.want {
			t.Errorf("IsURL(%q) = %v, want %v", c.s, got, c.want)
		}
	}
}

// TestResolve follows RFC 3986's reference resolution (section 5.4's
// examples are the model) and qemu's rule that a backing name is relative
// to the image's folder.
func TestResolve(t *testing.T) {
	for _, c := range []struct {
		base, name, want string
	}{
		{"https://h/img/vm.qcow2", "base.qcow2", "https://h/img/base.qcow2"},
		{"https://h/img/vm.qcow2", "../base/b.qcow2", "https://h/base/b.qcow2"},
		{"https://h/img/vm.qcow2", "./x/../b", "https://h/img/b"},
		{"https://h/img/vm.qcow2", "/abs/b.qcow2", "https://h/abs/b.qcow2"},
		{"https://u:p@h/img/vm.qcow2", "b", "https://u:p@h/img/b"},
		{"https://h/img/vm.qcow2?X-Amz-Signature=s", "b", "https://h/img/b"},
		{"s3://bkt/a/b/vm.qcow2", "base.qcow2", "s3://bkt/a/b/base.qcow2"},
		{"s3://bkt/a/b/vm.qcow2", "../../../../x", "s3://bkt/x"}, // dot segments stop at the root
		{"s3://bkt/a/vm.qcow2", "http://other/x", "http://other/x"},
	} {
		got, err := Resolve(c.base, c.name)
		if err != nil || got != c.want {
			t.Errorf("Resolve(%q, %q) = %q, %v; want %q", c.base, c.name, got, err, c.want)
		}
	}
	for _, c := range []struct{ base, name string }{
		{"https://h/img/vm.qcow2", "file:///etc/passwd"},
		{"https://h/img/vm.qcow2", "nbd://h/x"},
		{"https://h/img/vm.qcow2", "json:{\"driver\":\"file\"}"},
		{"https://h/img/vm.qcow2", "//evil/x"},
		{"https://h/img/vm.qcow2", ""},
		{"/local/vm.qcow2", "b"},
	} {
		if got, err := Resolve(c.base, c.name); !errors.Is(err, ErrBadURL) {
			t.Errorf("Resolve(%q, %q) = %q, %v; want ErrBadURL", c.base, c.name, got, err)
		}
	}
}

func TestWithin(t *testing.T) {
	prefixes := []string{"s3://bkt/images/", "https://h/pub"}
	for _, c := range []struct {
		u    string
		want bool
	}{
		{"s3://bkt/images/vm.qcow2", true},
		{"s3://bkt/images/a/b/c", true},
		{"s3://bkt/images2/x", false},
		{"s3://bkt/other/x", false},
		{"s3://other/images/x", false},
		{"https://h/pub/x", true},
		{"https://h:443/pub/x", true},
		{"https://H/pub/x", true},
		{"http://h/pub/x", false}, // another scheme
		{"https://h:8443/pub/x", false},
		{"https://h/public/x", false},
		{"https://h/pub/../secret", false},
		{"https://h/pub/%2e%2e/secret", false},
		{"https://h/pub/a/%2E%2E/%2e%2e/secret", false},
		{"https://u:p@h/pub/x?sig=1", true},
		{"file:///pub/x", false},
	} {
		if got := Within(c.u, prefixes); got != c.want {
			t.Errorf("Within(%q) = %v, want %v", c.u, got, c.want)
		}
	}
	// Resolve then Within: a backing file that climbs out is refused.
	u, err := Resolve("s3://bkt/images/vm.qcow2", "../secret/base.qcow2")
	if err != nil || Within(u, prefixes) {
		t.Errorf("Resolve+Within of ../secret: %q, %v, within %v", u, err, Within(u, prefixes))
	}
}

func TestRedact(t *testing.T) {
	secrets := []string{"hunter2", "sekritSig", "AKIAXYZ", "tok3n"}
	for _, raw := range []string{
		"https://alice:hunter2@h/x.qcow2",
		"https://h/x?X-Amz-Signature=sekritSig&X-Amz-Credential=AKIAXYZ&X-Amz-Security-Token=tok3n",
		"https://h/x?Signature=sekritSig&AWSAccessKeyId=AKIAXYZ",
		"https://h/x?sig=sekritSig&token=tok3n",
		"https://alice:hunter2@h/%zz?sig=sekritSig", // does not parse
	} {
		got := Redact(raw)
		for _, s := range secrets {
			if strings.Contains(got, s) {
				t.Errorf("Redact(%q) = %q: shows %q", raw, got, s)
			}
		}
	}
	if got := Redact("https://h/dir/x.qcow2?part=2"); got != "https://h/dir/x.qcow2?part=2" {
		t.Errorf("Redact changed a URL with nothing secret: %q", got)
	}
}

func TestSameObject(t *testing.T) {
	for _, c := range []struct {
		a, b string
		same bool
	}{
		{"https://h/vm.qcow2", "https://h/vm.qcow2", true},
		{"https://h/vm.qcow2", "HTTPS://H:443/vm.qcow2", true},
		{"https://u:p@h/vm.qcow2", "https://h/vm.qcow2", true},
		{"https://h/vm.qcow2?X-Amz-Signature=a&X-Amz-Date=1", "https://h/vm.qcow2?X-Amz-Signature=b&X-Amz-Date=2", true},
		{"https://h/vm.qcow2?id=1", "https://h/vm.qcow2?id=2", false},
		{"https://h/vm.qcow2", "http://h/vm.qcow2", false},
		{"https://h/vm.qcow2", "https://h/vm2.qcow2", false},
		{"https://h:8443/vm.qcow2", "https://h/vm.qcow2", false},
		{"s3://b/k/vm.qcow2", "s3://b/k/vm.qcow2", true},
		{"s3://b/k/vm.qcow2", "s3://c/k/vm.qcow2", false},
		{"/local/vm.qcow2", "/local/vm.qcow2", false},
	} {
		if got := SameObject(c.a, c.b); got != c.same {
			t.Errorf("SameObject(%q, %q) = %v, want %v", c.a, c.b, got, c.same)
		}
	}
	if got := WithoutUserinfo("https://u:p@h/x?sig=1"); got != "https://h/x?sig=1" {
		t.Errorf("WithoutUserinfo: %q", got)
	}
}
