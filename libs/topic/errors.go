package topic

import (
	"errors"
	"fmt"
)

// ErrEmpty reports an empty topic name or topic filter. Both must be at least
// one character long [MQTT-4.7.3-1].
var ErrEmpty = errors.New("topic: empty")

// ErrTooLong reports a topic name or filter longer than [Limits.MaxLength]
// bytes.
var ErrTooLong = errors.New("topic: too long")

// ErrTooManyLevels reports a topic name or filter with more levels than
// [Limits.MaxLevels].
var ErrTooManyLevels = errors.New("topic: too many levels")

// ErrInvalidUTF8 reports a string that is not well-formed UTF-8, including the
// encoding of a UTF-16 surrogate (U+D800..U+DFFF) [MQTT-1.5.4-1].
var ErrInvalidUTF8 = errors.New("topic: invalid utf-8")

// ErrDisallowedCodePoint reports well-formed UTF-8 that encodes a code point a
// topic may not contain: the null character U+0000 [MQTT-1.5.4-2], a control
// character (U+0001..U+001F, U+007F..U+009F) or a Unicode non-character
// (U+FDD0..U+FDEF, U+nFFFE, U+nFFFF). MQTT 5.0 section 1.5.4 lets a receiver
// treat the latter two groups as a malformed packet; Keel does, as mosquitto
// does. It wraps [ErrInvalidUTF8].
var ErrDisallowedCodePoint = fmt.Errorf("%w: disallowed code point", ErrInvalidUTF8)

// ErrWildcardInName reports a '+' or '#' in a topic name, where wildcards are
// not allowed [MQTT-3.3.2-2] (MQTT 3.1.1: [MQTT-4.7.1-1]).
var ErrWildcardInName = errors.New("topic: wildcard in topic name")

// ErrInvalidWildcard reports a '#' that is not the whole last level
// [MQTT-4.7.1-1], or a '+' that does not occupy a whole level [MQTT-4.7.1-2].
// (MQTT 3.1.1 numbers the same rules [MQTT-4.7.1-2] and [MQTT-4.7.1-3].)
var ErrInvalidWildcard = errors.New("topic: invalid wildcard")

// ErrInvalidShare reports a malformed shared subscription filter: a
// "$share/" filter whose ShareName is empty [MQTT-4.8.2-1], contains '+' or
// '#', or is not followed by '/' and a topic filter [MQTT-4.8.2-2]; or a
// "$queue/" filter with no topic filter after the prefix.
var ErrInvalidShare = errors.New("topic: invalid shared subscription")
