package topic

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestMatch(t *testing.T) {
	t.Parallel()
	for _, tc := range matchCases {
		require.Equal(t, tc.want, Match(tc.filter, tc.topic), "Match(%q, %q)", tc.filter, tc.topic)
	}
}

// TestMatch_InvalidInput pins down what Match does with input that validation
// rejects, since Trie must agree with it.
func TestMatch_InvalidInput(t *testing.T) {
	t.Parallel()
	for _, tc := range []matchCase{
		{"a/#/b", "a/x/b", false}, // a non-final '#' is a literal level
		{"a/#/b", "a/#/b", true},
		{"#/b", "$x/b", false},
		{"#/b", "#/b", true},
		{"a+", "a+", true}, // a partial wildcard is literal
		{"a+", "ab", false},
		{"+", "+", true},
		{"#", "#", true},
		{"", "", true},
		{"+", "", true},
		{"#", "", true},
		{"a", "", false},
		{"", "a", false},
		{"$share/g/#", "$share/g/x", true}, // share prefixes are not special
	} {
		require.Equal(t, tc.want, Match(tc.filter, tc.topic), "Match(%q, %q)", tc.filter, tc.topic)
	}
}

func TestMatch_Allocs(t *testing.T) {
	allocs := testing.AllocsPerRun(100, func() {
		for _, tc := range matchCases {
			Match(tc.filter, tc.topic)
		}
	})
	require.Zero(t, allocs)
}

func TestAnchor(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ filter, want string }{
		{"a/b/c", "a/b/c"}, // an exact topic is its own anchor
		{"a/b/+/c", "a/b"},
		{"a/b/#", "a/b"},
		{"a/#", "a"},
		{"a/+", "a"},
		{"#", ""},
		{"+", ""},
		{"+/a/b", ""},
		{"/+", ""}, // the empty first level and "no level" are the same string
		{"/a/+", "/a"},
		{"a//+", "a/"},
		{"a/", "a/"},
		{"/", "/"},
		{"$SYS/#", "$SYS"},
		{"a/b+/c", "a/b+/c"}, // partial wildcards are literal, as in Match
		{"a/#/b", "a/#/b"},
		{"a/#/+", "a/#"},
		{"", ""},
	} {
		got := Anchor(tc.filter)
		require.Equal(t, tc.want, got, "Anchor(%q)", tc.filter)
		require.True(t, strings.HasPrefix(tc.filter, got))
	}
}

func TestAnchor_Allocs(t *testing.T) {
	allocs := testing.AllocsPerRun(100, func() {
		Anchor("a/b/+/c")
		Anchor("a/b/c/d/e")
	})
	require.Zero(t, allocs)
}

// checkAnchor checks the property routing relies on: every topic a filter
// matches is its anchor or lies below it.
func checkAnchor(t *testing.T, filter, topic string) {
	t.Helper()
	if !Match(filter, topic) {
		return
	}
	a := Anchor(filter)
	ok := a == "" || topic == a || strings.HasPrefix(topic, a+"/")
	require.True(t, ok, "Match(%q, %q) but anchor %q is not a level prefix", filter, topic, a)
}

func TestAnchor_Property(t *testing.T) {
	t.Parallel()
	for _, tc := range matchCases {
		checkAnchor(t, tc.filter, tc.topic)
	}
}
