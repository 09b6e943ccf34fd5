// Package topic validates and matches MQTT topic names and topic filters, as
// defined by MQTT 3.1.1 and 5.0 section 4.7.
//
// A topic name is what a PUBLISH carries; a topic filter is what a SUBSCRIBE
// carries and may contain the wildcards '+' (one whole level) and '#' (the
// whole last level, matching the parent level and any number of children).
// Levels are separated by '/' and may be empty: "a//b", "/x" and "x/" each
// have an empty level.
//
// [ValidateName] and [ValidateFilter] check untrusted input against the
// specification and a [Limits]. [ParseShare] splits a shared subscription
// ("$share/<group>/<filter>" or "$queue/<filter>") into its group and inner
// filter. [Match] is the simple reference matcher of one filter against one
// topic, [Anchor] gives the literal prefix a routing table partitions by, and
// [Trie] matches a topic against many filters at once.
//
// Matching never looks at share prefixes: strip them with [ParseShare] and
// match the inner filter. Matching assumes its inputs have been validated; for
// any other input it is still safe and deterministic (see [Match]).
//
// Nothing here normalises or rewrites topics [MQTT-4.7.3-4]: bytes are compared
// as they are.
package topic
