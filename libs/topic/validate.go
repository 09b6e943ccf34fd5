package topic

import "unicode/utf8"

// MaxTopicLength is the longest topic name or topic filter MQTT can carry, in
// bytes: a UTF-8 Encoded String has a two-byte length [MQTT-4.7.3-3].
const MaxTopicLength = 65535

// Limits bounds the topic names and filters that [ValidateName] and
// [ValidateFilter] accept, beyond what the specification requires.
type Limits struct {
	// MaxLength is the longest accepted topic, in bytes. Zero or less means
	// [MaxTopicLength]; a larger value is capped at [MaxTopicLength], because
	// a longer topic cannot be sent to any MQTT client [MQTT-4.7.3-3].
	MaxLength int `yaml:"max_length"`
	// MaxLevels is the most levels an accepted topic may have; zero or less
	// means no limit. A topic has one level more than it has '/' separators.
	// For a shared subscription it counts the levels of the inner filter,
	// which is what gets matched.
	MaxLevels int `yaml:"max_levels"`
}

func (l Limits) maxLength() int {
	if l.MaxLength <= 0 || l.MaxLength > MaxTopicLength {
		return MaxTopicLength
	}
	return l.MaxLength
}

// ValidateName reports whether topic is a valid topic name, such as a PUBLISH
// carries, within limits. It returns nil or one of [ErrEmpty], [ErrTooLong],
// [ErrInvalidUTF8], [ErrDisallowedCodePoint], [ErrWildcardInName] and
// [ErrTooManyLevels]. It does not allocate.
//
// Names that start with '$' (such as "$SYS/broker/uptime") are valid here;
// whether a client may publish to them is a question of authorisation.
func ValidateName(topic string, limits Limits) error {
	if topic == "" {
		return ErrEmpty // [MQTT-4.7.3-1]
	}
	if len(topic) > limits.maxLength() {
		return ErrTooLong
	}
	return scan(topic, false, limits.MaxLevels)
}

// ValidateFilter reports whether filter is a valid topic filter, such as a
// SUBSCRIBE or UNSUBSCRIBE carries, within limits. A shared subscription
// ("$share/<group>/<filter>" or "$queue/<filter>", see [ParseShare]) is valid
// when its share form is and its inner filter is. It returns nil or one of
// [ErrEmpty], [ErrTooLong], [ErrInvalidUTF8], [ErrDisallowedCodePoint],
// [ErrInvalidWildcard], [ErrInvalidShare] and [ErrTooManyLevels]. It does not
// allocate.
func ValidateFilter(filter string, limits Limits) error {
	if filter == "" {
		return ErrEmpty // [MQTT-4.7.3-1]
	}
	if len(filter) > limits.maxLength() {
		return ErrTooLong
	}
	group, inner, ok, err := ParseShare(filter)
	if err != nil {
		return err
	}
	if !ok {
		return scan(filter, true, limits.MaxLevels)
	}
	// ParseShare has rejected '/', '+' and '#' in the group; what remains is
	// the UTF-8 check. The "$share/" and "$queue/" prefixes are plain ASCII.
	if err := scan(group, false, 0); err != nil {
		return err
	}
	return scan(inner, true, limits.MaxLevels)
}

// scan checks, in one pass, that s is well-formed UTF-8 without disallowed
// code points, that its wildcards (if filter) are whole levels with '#' only
// last, or that it has none (if not filter), and that it has at most
// maxLevels levels (if maxLevels > 0). It reports the first error by position.
func scan(s string, filter bool, maxLevels int) error {
	levels := 1
	levelStart := 0
	for i := 0; i < len(s); {
		cls := byteClass[s[i]]
		if cls == classPlain {
			i++
			continue
		}
		switch cls {
		case classMultibyte:
			r, size := utf8.DecodeRuneInString(s[i:])
			if r == utf8.RuneError && size == 1 {
				// Malformed, overlong, a surrogate or beyond U+10FFFF
				// [MQTT-1.5.4-1]. An encoded U+FFFD has size 3 and is fine.
				return ErrInvalidUTF8
			}
			if disallowed(r) {
				return ErrDisallowedCodePoint
			}
			i += size
			continue
		case classSlash:
			levels++
			if maxLevels > 0 && levels > maxLevels {
				return ErrTooManyLevels
			}
			levelStart = i + 1
		case classPlus:
			if !filter {
				return ErrWildcardInName
			}
			if i != levelStart || (i+1 < len(s) && s[i+1] != '/') {
				return ErrInvalidWildcard // [MQTT-4.7.1-2]
			}
		case classHash:
			if !filter {
				return ErrWildcardInName
			}
			if i != levelStart || i+1 != len(s) {
				return ErrInvalidWildcard // [MQTT-4.7.1-1]
			}
		case classControl:
			// U+0000 [MQTT-1.5.4-2] [MQTT-4.7.3-2], U+0001..U+001F, U+007F.
			return ErrDisallowedCodePoint
		}
		i++
	}
	return nil
}

// disallowed reports whether the non-ASCII code point r may not appear in a
// topic: a C1 control character or a Unicode non-character (MQTT 5.0 section
// 1.5.4 lets a receiver treat both as malformed).
func disallowed(r rune) bool {
	return r <= 0x9F || // C1 controls U+0080..U+009F
		(r >= 0xFDD0 && r <= 0xFDEF) || // non-characters
		r&0xFFFE == 0xFFFE // U+nFFFE and U+nFFFF in every plane
}

const (
	classPlain uint8 = iota
	classSlash
	classPlus
	classHash
	classControl
	classMultibyte
)

// byteClass sorts bytes for scan, so that the common case, a plain ASCII
// byte, costs one table lookup.
var byteClass = func() (t [256]uint8) {
	for c := range 0x20 {
		t[c] = classControl
	}
	t[0x7F] = classControl
	for c := utf8.RuneSelf; c < len(t); c++ {
		t[c] = classMultibyte
	}
	t['/'] = classSlash
	t['+'] = classPlus
	t['#'] = classHash
	return t
}()
