package tenancy

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestScope_RoundTrips(t *testing.T) {
	t.Parallel()
	acme, err := NewScope("acme")
	require.NoError(t, err)
	for _, tc := range []struct {
		name, outside, internal string
	}{
		{"plain", "a/b", "acme/a/b"},
		{"leading_slash", "/a", "acme//a"},
		{"wildcard", "#", "acme/#"},
		{"plus_first", "+/x", "acme/+/x"},
		{"sys", "$SYS/broker/x", "$:acme/$SYS/broker/x"},
		{"dollar_other", "$aws/things", "$:acme/$aws/things"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := acme.Topic(tc.outside)
			require.Equal(t, tc.internal, in)
			out, ok := acme.ExternalTopic(in)
			require.True(t, ok)
			require.Equal(t, tc.outside, out)
			tenant, ext, ok := TenantOfTopic(in)
			require.True(t, ok)
			require.Equal(t, "acme", tenant)
			require.Equal(t, tc.outside, ext)
			for _, id := range []string{"", "dev-1"} {
				topic, clientID := acme.TopicAndClientID(tc.outside, id)
				require.Equal(t, in, topic)
				require.Equal(t, map[bool]string{true: "", false: acme.ClientID(id)}[id == ""], clientID)
			}
		})
	}
	topic, clientID := acme.TopicAndClientID("", "dev-1")
	require.Empty(t, topic)
	require.Equal(t, acme.ClientID("dev-1"), clientID)
}

func TestScope_Filter(t *testing.T) {
	t.Parallel()
	acme, _ := NewScope("acme")
	for _, tc := range []struct {
		name, outside, internal, back string
		shared                        bool
	}{
		{"plain", "a/+", "acme/a/+", "a/+", false},
		{"share", "$share/g/a/#", "$share/g/acme/a/#", "$share/g/a/#", true},
		{"share_sys", "$share/g/$SYS/#", "$share/g/$:acme/$SYS/#", "$share/g/$SYS/#", true},
		{"queue", "$queue/jobs", "$share/$queue/acme/jobs", "$queue/jobs", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in, shared := acme.Filter(tc.outside)
			require.Equal(t, tc.internal, in)
			require.Equal(t, tc.shared, shared)
			back, ok := acme.ExternalFilter(in)
			require.True(t, ok)
			require.Equal(t, tc.back, back)
		})
	}
}

// Tenant isolation rests on these: no internal name of one tenant is a valid
// name of another, and the $-form never looks like a share.
func TestScope_NoCrossTenantNames(t *testing.T) {
	t.Parallel()
	a, _ := NewScope("a")
	ab, _ := NewScope("a-b")
	share, _ := NewScope("share")
	_, ok := ab.ExternalTopic(a.Topic("b/x"))
	require.False(t, ok)
	_, ok = a.ExternalTopic(ab.Topic("x"))
	require.False(t, ok)
	_, ok = a.ExternalClientID(ab.ClientID("x"))
	require.False(t, ok)
	in, shared := share.Filter("$x/y")
	require.False(t, shared)
	require.NotContains(t, in[:7], "$share/")
	// "1:a" + "bc" must not be confusable with "2:ab" + "c".
	one, _ := NewScope("a")
	two, _ := NewScope("ab")
	require.NotEqual(t, one.ClientID("bc"), two.ClientID("c"))
	tenant, id, ok := TenantOfClientID(two.ClientID("c"))
	require.True(t, ok)
	require.Equal(t, "ab", tenant)
	require.Equal(t, "c", id)
}

func TestValidTenant(t *testing.T) {
	t.Parallel()
	for name, want := range map[string]bool{
		"acme": true, "a-1": true, "": false, "Acme": false, "a/b": false, "a b": false, "$sys": false,
		"0123456789012345678901234567890123456789012345678901234567890123": false, // 64
	} {
		require.Equal(t, want, ValidTenant(name), name)
	}
}

func BenchmarkScope_ExternalTopic(b *testing.B) {
	acme, _ := NewScope("acme")
	in := acme.Topic("devices/42/telemetry")
	b.ReportAllocs()
	for b.Loop() {
		if _, ok := acme.ExternalTopic(in); !ok {
			b.Fatal("not ours")
		}
	}
}

func FuzzTenantOfClientID(f *testing.F) {
	f.Add("4:acmedev")
	f.Add("")
	f.Add("99:x")
	f.Add("1:")
	f.Fuzz(func(t *testing.T, s string) {
		tenant, id, ok := TenantOfClientID(s)
		if !ok || !ValidTenant(tenant) {
			return
		}
		sc, err := NewScope(tenant)
		if err != nil {
			t.Fatal(err)
		}
		if sc.ClientID(id) != s {
			t.Fatalf("round trip %q -> %q,%q -> %q", s, tenant, id, sc.ClientID(id))
		}
	})
}
