package topic

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestValidateName(t *testing.T) {
	t.Parallel()
	for _, tc := range validateCases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			require.ErrorIs(t, ValidateName(tc.input, tc.limits), tc.asName, "%q", tc.input)
			if tc.asName == nil {
				require.NoError(t, ValidateName(tc.input, tc.limits), "%q", tc.input)
			}
		})
	}
}

func TestValidateFilter(t *testing.T) {
	t.Parallel()
	for _, tc := range validateCases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			require.ErrorIs(t, ValidateFilter(tc.input, tc.limits), tc.asFilt, "%q", tc.input)
			if tc.asFilt == nil {
				require.NoError(t, ValidateFilter(tc.input, tc.limits), "%q", tc.input)
			}
		})
	}
}

// TestValidate_MaxTopicLength checks the protocol limit of 65,535 bytes
// [MQTT-4.7.3-3], which applies whatever Limits.MaxLength says.
func TestValidate_MaxTopicLength(t *testing.T) {
	t.Parallel()
	atMax := strings.Repeat("a", MaxTopicLength)
	overMax := atMax + "b"
	for _, tc := range []struct {
		name   string
		limits Limits
	}{
		{"zero", Limits{}},
		{"negative", Limits{MaxLength: -1}},
		{"above_protocol", Limits{MaxLength: 1 << 20}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			require.NoError(t, ValidateName(atMax, tc.limits))
			require.NoError(t, ValidateFilter(atMax, tc.limits))
			require.ErrorIs(t, ValidateName(overMax, tc.limits), ErrTooLong)
			require.ErrorIs(t, ValidateFilter(overMax, tc.limits), ErrTooLong)
		})
	}
}

func TestValidate_ErrorsWrap(t *testing.T) {
	t.Parallel()
	require.ErrorIs(t, ErrDisallowedCodePoint, ErrInvalidUTF8)
	for _, err := range []error{ErrEmpty, ErrTooLong, ErrTooManyLevels, ErrWildcardInName, ErrInvalidWildcard, ErrInvalidShare} {
		require.NotErrorIs(t, err, ErrInvalidUTF8)
	}
}

func TestValidate_Allocs(t *testing.T) {
	inputs := []string{"sport/tennis/player1", "日本/caf\u00e9", "$share/g/a/+/#", "a\x00", "\xff", "a#", "a/b/c/d"}
	allocs := testing.AllocsPerRun(100, func() {
		for _, s := range inputs {
			_ = ValidateName(s, Limits{MaxLevels: 3})
			_ = ValidateFilter(s, Limits{MaxLevels: 3})
		}
	})
	require.Zero(t, allocs)
}

func TestParseShare(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, filter string
		group, inner string
		ok           bool
		err          error
	}{
		{"share", "$share/g/a/+", "g", "a/+", true, nil},
		{"share_hash", "$share/consumer1/#", "consumer1", "#", true, nil},
		{"share_dollar_inner", "$share/g/$SYS/#", "g", "$SYS/#", true, nil},
		{"share_empty_inner_level", "$share/g//", "g", "/", true, nil},
		{"share_nested", "$share/g/$share/h/x", "g", "$share/h/x", true, nil},
		{"queue", "$queue/a/b", QueueGroup, "a/b", true, nil},
		{"queue_hash", "$queue/#", QueueGroup, "#", true, nil},
		{"queue_as_share_group", "$share/$queue/a/b", QueueGroup, "a/b", true, nil},
		{"plain", "a/b", "", "", false, nil},
		{"plain_dollar", "$SYS/#", "", "", false, nil},
		{"share_word", "$share", "", "", false, nil},
		{"queue_word", "$queue", "", "", false, nil},
		{"share_case", "$SHARE/g/a", "", "", false, nil},
		{"share_not_first", "a/$share/g/b", "", "", false, nil},
		{"no_group", "$share//a", "", "", true, ErrInvalidShare},      // [MQTT-4.8.2-1]
		{"bare_prefix", "$share/", "", "", true, ErrInvalidShare},     // [MQTT-4.8.2-1]
		{"no_slash", "$share/g", "", "", true, ErrInvalidShare},       // [MQTT-4.8.2-2]
		{"no_filter", "$share/g/", "", "", true, ErrInvalidShare},     // [MQTT-4.8.2-2]
		{"plus_group", "$share/+/a", "", "", true, ErrInvalidShare},   // [MQTT-4.8.2-2]
		{"hash_group", "$share/g#/a", "", "", true, ErrInvalidShare},  // [MQTT-4.8.2-2]
		{"queue_no_filter", "$queue/", "", "", true, ErrInvalidShare}, //
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			group, inner, ok, err := ParseShare(tc.filter)
			require.ErrorIs(t, err, tc.err)
			if tc.err == nil {
				require.NoError(t, err)
			}
			require.Equal(t, tc.ok, ok)
			require.Equal(t, tc.group, group)
			require.Equal(t, tc.inner, inner)
		})
	}
}

// refValidate is a slow, independent statement of the validation rules. It
// returns every rule s breaks; scan reports the first by position, so its
// answer must be one of them. Empty, too long and malformed share forms are
// checked first by both, in that order.
func refValidate(s string, filter bool, limits Limits) []error {
	if s == "" {
		return []error{ErrEmpty}
	}
	maxLen := limits.MaxLength
	if maxLen <= 0 || maxLen > MaxTopicLength {
		maxLen = MaxTopicLength
	}
	if len(s) > maxLen {
		return []error{ErrTooLong}
	}
	var errs []error
	if filter {
		if rest, ok := strings.CutPrefix(s, "$queue/"); ok {
			if rest == "" {
				return []error{ErrInvalidShare}
			}
			s = rest
		} else if rest, ok := strings.CutPrefix(s, "$share/"); ok {
			parts := strings.SplitN(rest, "/", 2)
			if len(parts) != 2 || parts[0] == "" || parts[1] == "" || strings.ContainsAny(parts[0], "+#") {
				return []error{ErrInvalidShare}
			}
			errs = append(errs, refValidate(parts[0], false, Limits{})...)
			s = parts[1]
		}
	}
	for i, r := range s {
		switch {
		case r == 0xFFFD && !strings.HasPrefix(s[i:], "\ufffd"):
			errs = append(errs, ErrInvalidUTF8)
		case r < 0x20, r >= 0x7F && r <= 0x9F, r >= 0xFDD0 && r <= 0xFDEF, r&0xFFFE == 0xFFFE:
			errs = append(errs, ErrDisallowedCodePoint)
		}
	}
	levels := strings.Split(s, "/")
	if limits.MaxLevels > 0 && len(levels) > limits.MaxLevels {
		errs = append(errs, ErrTooManyLevels)
	}
	for i, l := range levels {
		if !strings.ContainsAny(l, "+#") {
			continue
		}
		switch {
		case !filter:
			errs = append(errs, ErrWildcardInName)
		case l == "+", l == "#" && i == len(levels)-1:
		default:
			errs = append(errs, ErrInvalidWildcard)
		}
	}
	return errs
}

// checkValidate compares ValidateName and ValidateFilter with refValidate.
func checkValidate(t *testing.T, s string, limits Limits) {
	t.Helper()
	for _, filter := range []bool{false, true} {
		var got error
		if filter {
			got = ValidateFilter(s, limits)
		} else {
			got = ValidateName(s, limits)
		}
		want := refValidate(s, filter, limits)
		if len(want) == 0 {
			require.NoError(t, got, "filter=%v %q %+v", filter, s, limits)
			continue
		}
		require.Error(t, got, "filter=%v %q %+v: want one of %v", filter, s, limits, want)
		found := false
		for _, w := range want {
			found = found || errors.Is(got, w) && errors.Is(w, got)
		}
		require.True(t, found, "filter=%v %q %+v: got %v, want one of %v", filter, s, limits, got, want)
	}
}

func TestValidate_Reference(t *testing.T) {
	t.Parallel()
	for _, tc := range validateCases {
		checkValidate(t, tc.input, tc.limits)
	}
}
