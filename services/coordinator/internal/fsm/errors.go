package fsm

import "errors"

// ErrInvalidArgument is returned for a command field that is malformed or too long.
var ErrInvalidArgument = errors.New("invalid argument")

// ErrStaleEpoch is returned when a release names an epoch older than the record's.
var ErrStaleEpoch = errors.New("stale epoch")

// ErrNotOwner is returned when a release comes from an edge that does not own the
// session.
var ErrNotOwner = errors.New("not the owner")

// ErrStaleIncarnation is returned when a member record would go back to an older
// incarnation.
var ErrStaleIncarnation = errors.New("stale incarnation")

// ErrUnknownCommand is returned by [Decode] for a command type with no handler
// and without the ignore-if-unknown flag. [FSM.Apply] panics on it instead.
var ErrUnknownCommand = errors.New("unknown command type")

// ErrMalformedEntry is returned by [Decode] for an entry that is empty or whose
// payload does not unmarshal.
var ErrMalformedEntry = errors.New("malformed log entry")

// ErrCorruptSnapshot is returned by [FSM.Restore] for a snapshot that cannot be read.
var ErrCorruptSnapshot = errors.New("corrupt snapshot")
