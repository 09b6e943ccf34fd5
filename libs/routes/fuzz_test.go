package routes

import (
	"strings"
	"testing"

	"github.com/keelmq/keel/libs/topic"
)

// FuzzValidate: routes and topics from edges are validated before anything
// is stored; whatever passes must be usable by the table (anchor, probes,
// matching) without surprises.
func FuzzValidate(f *testing.F) {
	for _, s := range []struct{ tenant, filter, group, topic string }{
		{"t1", "a/b", "", "a/b"}, {"t1", "+/b/#", "", "$SYS/b"}, {"t1", "a/#", "g1", "a"}, {"T1", "a", "", "a"},
		{"t1", "$share/g/a", "", "a"}, {"t1", "a", "g/x", "a"}, {"t1", "a/#/b", "", "a/+"}, {"t1", "a\x00b", "", "a\x00b"},
		{"t1", "/+/x", "", "/y/x"}, {"t1", "#", "$queue", "x"}, {"t-1", strings.Repeat("a/", 40), "", "a"},
	} {
		f.Add(s.tenant, s.filter, s.group, s.topic)
	}
	f.Fuzz(func(t *testing.T, tenant, filter, group, name string) {
		k := Key{Tenant: tenant, Filter: filter, Group: group}
		if Validate(k, DefaultLimits) == nil {
			if !ValidTenant(tenant) || len(filter) > DefaultLimits.MaxLength {
				t.Fatalf("accepted %v", k)
			}
			a := k.Anchor()
			if !strings.HasPrefix(filter, a) {
				t.Fatalf("anchor %q not a prefix of %q", a, filter)
			}
			if ValidateTopic(tenant, name, DefaultLimits) == nil && topic.Match(filter, name) && a != "" {
				// A matching topic must probe the filter's anchor.
				found := false
				ProbeAnchors(name, func(p string) bool { found = found || p == a; return true })
				if !found {
					t.Fatalf("topic %q matches %q but never probes anchor %q", name, filter, a)
				}
			}
			_ = Hash(k)
		}
		if ValidateTopic(tenant, name, DefaultLimits) == nil {
			n := 0
			ProbeAnchors(name, func(string) bool { n++; return true })
			if n == 0 || n > strings.Count(name, "/")+1 {
				t.Fatalf("%d probes for %q", n, name)
			}
		}
	})
}

// FuzzBloomFromBits: filters streamed to edges are rebuilt from untrusted
// parameters; a bad header is refused, a good one never panics.
func FuzzBloomFromBits(f *testing.F) {
	f.Add([]byte{1, 2, 3, 4, 5, 6, 7, 8}, uint64(64), uint32(3), "a/b")
	f.Add([]byte{1}, uint64(7), uint32(1), "")
	f.Add([]byte{}, uint64(0), uint32(0), "x")
	f.Fuzz(func(t *testing.T, bits []byte, m uint64, k uint32, anchor string) {
		b, err := BloomFromBits(bits, m, k)
		if err != nil {
			return
		}
		b.Add(anchor)
		if !b.MayContain(anchor) {
			t.Fatal("added anchor not found")
		}
	})
}
