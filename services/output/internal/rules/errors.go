package rules

import (
	"errors"
	"fmt"
)

// ErrInvalid is wrapped by every error [Parse] and [Load] return for a rules
// file that cannot be used.
var ErrInvalid = errors.New("invalid rules")

// Error is one problem in a rules file, located by line and by path.
type Error struct {
	File string // file name, or "" when parsed from memory
	Line int    // 1-based line; 0 when unknown
	Path string // e.g. "tenants.acme.rules[0].filters[1]"
	Msg  string
}

func (e *Error) Error() string {
	loc := e.File
	if e.Line > 0 {
		loc = fmt.Sprintf("%s:%d", loc, e.Line)
	}
	if loc != "" {
		loc += ": "
	}
	if e.Path != "" {
		return loc + e.Path + ": " + e.Msg
	}
	return loc + e.Msg
}

// Unwrap makes every Error match [ErrInvalid].
func (e *Error) Unwrap() error { return ErrInvalid }
