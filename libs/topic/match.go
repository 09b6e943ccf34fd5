package topic

import "strings"

// Match reports whether the topic filter matches the topic name. It is the
// reference matcher: simple, allocation-free, and the definition [Trie]
// is tested against.
//
// Rules (MQTT 5.0 section 4.7): levels are compared byte for byte
// [MQTT-4.7.3-4]; '+' matches exactly one level, which may be empty
// [MQTT-4.7.1-2]; a final '#' matches the parent level and any number of
// child levels [MQTT-4.7.1-1], so "a/#" matches "a"; and a filter whose first
// level is a wildcard matches no topic that starts with '$' [MQTT-4.7.2-1].
//
// Both arguments should be valid (see [ValidateFilter] and [ValidateName]) and
// filter must not be a shared subscription (see [ParseShare]). For other input
// Match still terminates without panicking: a level is a wildcard only if it
// is exactly "+", or exactly "#" and last; any other level, such as "a+" or a
// "#" followed by more levels, is compared literally.
func Match(filter, topic string) bool {
	if dollarGuarded(filter, topic) {
		return false // [MQTT-4.7.2-1]
	}
	for {
		fl, frest, fmore := cutLevel(filter)
		if fl == "#" && !fmore {
			return true
		}
		tl, trest, tmore := cutLevel(topic)
		if fl != "+" && fl != tl {
			return false
		}
		switch {
		case !fmore:
			return !tmore
		case !tmore:
			// The filter has more levels than the topic; only a final "#"
			// matches the topic as its parent.
			return frest == "#"
		}
		filter, topic = frest, trest
	}
}

// dollarGuarded reports whether [MQTT-4.7.2-1] forbids filter to match topic:
// the topic starts with '$' and the filter's first level is a wildcard.
func dollarGuarded(filter, topic string) bool {
	if topic == "" || topic[0] != '$' || filter == "" {
		return false
	}
	switch filter[0] {
	case '+':
		return len(filter) == 1 || filter[1] == '/'
	case '#':
		return len(filter) == 1
	}
	return false
}

// cutLevel splits s at its first '/': level is the text before it, rest the
// text after, and more reports whether there was a '/'.
func cutLevel(s string) (level, rest string, more bool) {
	if i := strings.IndexByte(s, '/'); i >= 0 {
		return s[:i], s[i+1:], true
	}
	return s, "", false
}

// Anchor returns the literal levels of filter before its first wildcard, as
// a substring of filter (no allocation): "a/b/+/c" → "a/b", "a/#" → "a",
// "#" and "+/x" → "". A filter without wildcards is its own anchor.
//
// Every topic that filter matches equals the anchor or starts with the anchor
// followed by '/', which is what lets a routing table partition filters by
// anchor and find them by probing each level prefix of a topic. An empty
// anchor narrows nothing; it also results when the first literal level is
// empty ("/+/x"), because the empty level prefix and "no prefix" are the same
// string.
//
// filter must not be a shared subscription (see [ParseShare]). As in [Match],
// a level is a wildcard only if it is exactly "+", or exactly "#" and last.
func Anchor(filter string) string {
	for start := 0; ; {
		i := strings.IndexByte(filter[start:], '/')
		end := len(filter)
		if i >= 0 {
			end = start + i
		}
		switch filter[start:end] {
		case "+":
			return filter[:max(start-1, 0)]
		case "#":
			if i < 0 {
				return filter[:max(start-1, 0)]
			}
		}
		if i < 0 {
			return filter
		}
		start = end + 1
	}
}
