package topic

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

// maxFuzzFilters bounds how many filters one FuzzTrieMatchesReference input
// adds, so that each run stays fast.
const maxFuzzFilters = 64

// FuzzTrieMatchesReference adds the newline-separated filters to a Trie, value
// i for filters[i], and checks that Trie.Match visits exactly the values whose
// filters Match accepts for topic, that an early stop is honoured, that
// Anchor's routing property holds, that validation never panics, and that
// removing every pair empties the trie.
func FuzzTrieMatchesReference(f *testing.F) {
	var all []string
	for _, tc := range matchCases {
		f.Add(tc.filter, tc.topic)
		all = append(all, tc.filter)
	}
	for _, tc := range matchCases {
		f.Add(strings.Join(all[:min(len(all), maxFuzzFilters)], "\n"), tc.topic)
	}
	for _, tc := range validateCases {
		f.Add(tc.input, tc.input)
	}
	f.Add("a/#/b\n#/b\na+\n+\n#\n\n/\n//+", "a/#/b")
	f.Fuzz(func(t *testing.T, filterList, topic string) {
		filters := strings.Split(filterList, "\n")
		if len(filters) > maxFuzzFilters {
			filters = filters[:maxFuzzFilters]
		}
		_ = ValidateName(topic, Limits{})
		_ = ValidateFilter(topic, Limits{MaxLevels: 3})
		var tr Trie[int]
		var want []int
		for i, filter := range filters {
			_ = ValidateFilter(filter, Limits{})
			_ = ValidateName(filter, Limits{MaxLength: 8, MaxLevels: 2})
			_, _, _, _ = ParseShare(filter)
			a := Anchor(filter)
			require.True(t, strings.HasPrefix(filter, a), "Anchor(%q) = %q", filter, a)
			checkAnchor(t, filter, topic)

			require.True(t, tr.Add(filter, i))
			require.False(t, tr.Add(filter, i))
			if Match(filter, topic) {
				want = append(want, i)
			}
		}
		require.Equal(t, len(filters), tr.Len())

		var got []int
		tr.Match(topic, func(v int) bool {
			got = append(got, v)
			return true
		})
		slices.Sort(got)
		require.Equal(t, want, got, "filters %q topic %q", filters, topic)

		if len(want) > 0 {
			calls := 0
			tr.Match(topic, func(int) bool { calls++; return false })
			require.Equal(t, 1, calls)
		}

		for i, filter := range filters {
			require.True(t, tr.Remove(filter, i), "Remove(%q, %d)", filter, i)
		}
		requireEmpty(t, &tr)
	})
}

// FuzzValidate checks that validation never panics, agrees with the slow
// reference refValidate, and is consistent with itself and with Match.
func FuzzValidate(f *testing.F) {
	for _, tc := range validateCases {
		f.Add(tc.input, tc.limits.MaxLength, tc.limits.MaxLevels)
	}
	for _, tc := range matchCases {
		f.Add(tc.filter, 0, 0)
		f.Add(tc.topic, 0, 0)
	}
	f.Fuzz(func(t *testing.T, s string, maxLength, maxLevels int) {
		limits := Limits{MaxLength: maxLength, MaxLevels: maxLevels}
		checkValidate(t, s, limits)

		nameErr := ValidateName(s, limits)
		filterErr := ValidateFilter(s, limits)
		_, inner, isShare, shareErr := ParseShare(s)
		if nameErr == nil {
			require.True(t, utf8.ValidString(s))
			require.NotContains(t, s, "\x00")
			require.NotEmpty(t, s)
			require.LessOrEqual(t, len(s), MaxTopicLength)
			// A valid name, used as a filter, is valid unless it looks like
			// a malformed share, and matches itself and nothing else.
			if !isShare {
				require.NoError(t, filterErr, "%q", s)
			}
			require.True(t, Match(s, s), "%q", s)
			require.False(t, Match(s, s+"/x"), "%q", s)
			require.Equal(t, s, Anchor(s))
		}
		if filterErr == nil {
			require.True(t, utf8.ValidString(s))
			require.NotContains(t, s, "\x00")
			if isShare {
				require.NoError(t, shareErr)
				require.NotEmpty(t, inner)
			}
		}
		if shareErr != nil {
			// The length check comes first (testdata/fuzz/FuzzValidate/32b11ea56432363e).
			require.True(t, isShare)
			if !errors.Is(filterErr, ErrTooLong) {
				require.ErrorIs(t, filterErr, ErrInvalidShare)
			}
		}
	})
}
