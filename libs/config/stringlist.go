package config

import (
	"slices"
	"strings"
)

// StringList is a [flag.Value] holding a list of strings. Each Set splits its
// argument on commas, trims spaces, drops empty elements and appends the rest,
// so "-x a,b -x c" yields [a b c].
//
// Register it with fs.Var(&cfg.List, name, usage) after assigning the
// default to cfg.List. Under [Parse], values from the command line or the
// environment replace the default instead of appending to it; a plain
// fs.Parse appends to it.
type StringList []string

// String returns the elements joined by commas.
func (l *StringList) String() string {
	if l == nil {
		return ""
	}
	return strings.Join(*l, ",")
}

// Set appends the comma-separated elements of s.
func (l *StringList) Set(s string) error {
	// Clip so that appending never writes into a backing array shared with
	// the default the caller assigned.
	list := slices.Clip(*l)
	for part := range strings.SplitSeq(s, ",") {
		if part = strings.TrimSpace(part); part != "" {
			list = append(list, part)
		}
	}
	*l = list
	return nil
}

// Get returns the list as a []string; it implements [flag.Getter].
func (l *StringList) Get() any { return []string(*l) }
