package routes

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestValidate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		key  Key
		ok   bool
	}{
		{"plain", Key{"t1", "a/b", ""}, true},
		{"wildcard", Key{"t1", "+/b/#", ""}, true},
		{"shared", Key{"t1", "a/#", "g1"}, true},
		{"bad_tenant_upper", Key{"T1", "a", ""}, false},
		{"empty_tenant", Key{"", "a", ""}, false},
		{"bad_filter", Key{"t1", "a/#/b", ""}, false},
		{"empty_filter", Key{"t1", "", ""}, false},
		{"share_prefix_left", Key{"t1", "$share/g/a", ""}, false},
		{"bad_group", Key{"t1", "a", "g/x"}, false},
		{"wildcard_group", Key{"t1", "a", "g+"}, false},
		{"oversized", Key{"t1", string(make([]byte, 2000)), ""}, false},
		{"nul", Key{"t1", "a\x00b", ""}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := Validate(tc.key, DefaultLimits)
			if tc.ok {
				require.NoError(t, err)
			} else {
				require.Error(t, err)
			}
		})
	}
}

func TestProbeAnchors(t *testing.T) {
	t.Parallel()
	var got []string
	ProbeAnchors("a/b/c", func(a string) bool { got = append(got, a); return true })
	require.Equal(t, []string{"a", "a/b", "a/b/c"}, got)
	got = nil
	ProbeAnchors("/x/", func(a string) bool { got = append(got, a); return true })
	require.Equal(t, []string{"/x", "/x/"}, got)
}

func TestDigest_OrderIndependent(t *testing.T) {
	t.Parallel()
	var a, b Digest
	keys := []Key{{"t", "a", ""}, {"t", "b", "g"}, {"u", "a", ""}}
	for _, k := range keys {
		a.Add(k)
	}
	for i := len(keys) - 1; i >= 0; i-- {
		b.Add(keys[i])
	}
	require.Equal(t, a, b)
	b.Add(Key{"t", "c", ""})
	b.Remove(Key{"t", "c", ""})
	require.Equal(t, a, b)
	require.NotEqual(t, Hash(Key{"t", "a", "b"}), Hash(Key{"t", "b", "a"}))
}

func TestBloom(t *testing.T) {
	t.Parallel()
	b := NewBloom(10000, 0.01)
	for i := range 10000 {
		b.Add(fmt.Sprintf("devices/%d/cmd", i))
	}
	for i := range 10000 {
		require.True(t, b.MayContain(fmt.Sprintf("devices/%d/cmd", i)))
	}
	fp := 0
	for i := range 10000 {
		if b.MayContain(fmt.Sprintf("other/%d", i)) {
			fp++
		}
	}
	require.Less(t, fp, 300, "false positive rate far above 1%%")
	bits, m, k := b.Bits()
	c, err := BloomFromBits(append([]byte(nil), bits...), m, k)
	require.NoError(t, err)
	require.True(t, c.MayContain("devices/7/cmd"))
	_, err = BloomFromBits([]byte{1}, 7, 1)
	require.ErrorIs(t, err, ErrInvalidBloom)
}
